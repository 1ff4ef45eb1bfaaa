"""What a client is told about its budget and when to come back: the rate-limit headers of an
answer and the ``Retry-After`` / ``retry-after-ms`` of a refusal, in one place.

The budget is read through the core's read-only view (:meth:`Scheduler.budget
<tokenfair.core.scheduler.Scheduler.budget>`); times are converted from model time to the
client's real time by the sidecar's clock.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final

from tokenfair.core import Decision, Scheduler

if TYPE_CHECKING:
    from tokenfair.server.clock import ModelClock

FALLBACK_RETRY_AFTER_S: Final = 1
"""``Retry-After`` when the gate gives no time (a request that can never fit as sized)."""
IETF_POLICY: Final = "service-tokens"
"""The policy name (and quota unit) of the IETF ``RateLimit-Policy`` / ``RateLimit`` fields."""


def ietf_ratelimit_fields(
    burst: int, remaining: int, window_s: float, reset_s: float
) -> dict[str, str]:
    """The IETF fields (draft-ietf-httpapi-ratelimit-headers-10, Structured Fields): the policy
    ``"service-tokens";q=<burst>;qu="service-tokens";w=<seconds to refill from empty>`` and the
    state ``"service-tokens";r=<remaining>;t=<seconds until full>``. Service tokens, not the
    converted usage tokens: the policy should stay the same from response to response, and the
    conversion changes with each request's mix. ``qu`` is outside the draft's registry
    (``requests``, ``content-bytes``, ``concurrent-requests``): without it the quota would read
    as requests. ``w`` is at least 1 (the draft's window is a positive integer); ``t`` is
    rounded up."""
    return {
        "RateLimit-Policy": (
            f'"{IETF_POLICY}";q={burst};qu="{IETF_POLICY}";w={max(1, math.ceil(window_s))}'
        ),
        "RateLimit": f'"{IETF_POLICY}";r={remaining};t={math.ceil(reset_s)}',
    }


class RateLimits:
    """The rate-limit headers and retry times of one sidecar (its scheduler's budgets, its
    clock, and whether the IETF fields are sent)."""

    def __init__(self, scheduler: Scheduler, clock: ModelClock, *, ietf: bool = False) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.ietf = ietf

    def stamp_retry_after(self, decision: Decision) -> None:
        """Make a refusal's ``retry_after_ms`` the wait its client is told: a gate with no wait
        to give or none left gets the fallback (:meth:`retry_after_ms`), in model ms, so that
        the record says what the client got (a queue timeout recorded 0 while the client was
        told 1 s)."""
        if decision.retry_after_ms is None or decision.retry_after_ms <= 0:
            decision.retry_after_ms = FALLBACK_RETRY_AFTER_S * 1000.0 / self.clock.time_scale

    def retry_after_s(self, decision: Decision | None) -> int:
        """Seconds (ceil, at least 1) from the gate's ``retry_after_ms`` in real time."""
        if decision is None or decision.retry_after_ms is None:
            return FALLBACK_RETRY_AFTER_S
        return max(1, math.ceil(self.clock.real_seconds(decision.retry_after_ms)))

    def retry_after_ms(self, decision: Decision | None) -> int:
        """``retry-after-ms``: the gate's ``retry_after_ms`` in real milliseconds (ceil, at least
        1; never above :meth:`retry_after_s` times 1000). The openai SDK prefers it to
        ``Retry-After``, whose whole seconds would turn a 420 ms wait into 1 s. A gate with no
        wait to give (``None``) or none left (``0``: a request shed after waiting its whole
        limit) gets the fallback, 1000: the SDK takes any positive value as is, and 1 ms would
        send the retry straight back into the queue that just shed it."""
        if decision is None or decision.retry_after_ms is None or decision.retry_after_ms <= 0:
            return FALLBACK_RETRY_AFTER_S * 1000
        return max(1, math.ceil(self.clock.real_seconds(decision.retry_after_ms) * 1000.0))

    def headers(self, tenant_id: str, mix: tuple[int, int] | None = None) -> dict[str, str]:
        """Rate-limit headers from the tenant's budget (service tokens, see the docs):

        * ``x-tokenfair-ratelimit-{limit,remaining,reset}-service-tokens``: the bucket exactly
          (burst, level, real seconds until full);
        * ``x-ratelimit-{limit,remaining,reset}-tokens`` (OpenAI's names) in the tokens clients
          count (``usage.prompt_tokens + usage.completion_tokens``): the bucket converted with
          this request's own mix, ``usage / service`` where ``mix = (usage, service)`` is its
          estimate's ``prompt + max_tokens`` and service tokens (floored); without ``mix``, or
          for a request of 0 service tokens, 1:1;
        * with ``ietf_ratelimit_headers``, ``RateLimit-Policy`` and ``RateLimit``
          (:func:`ietf_ratelimit_fields`)."""
        clock = self.clock
        budget = self.scheduler.budget(tenant_id, clock.now_ms())
        if budget is None:
            return {}
        burst, sustained = budget.burst, budget.sustained_per_second
        reset_ms = max(0.0, burst - budget.level) * 1000.0 / sustained
        level = max(0.0, budget.level)  # in debt shows 0 remaining (the reset counts the debt)
        reset_s = clock.real_seconds(reset_ms)
        usage, service = mix if mix is not None else (1, 1)
        ratio = usage / service if service > 0 else 1.0
        reset = f"{reset_s:.3f}s"
        limit_service, remaining_service = math.floor(burst), math.floor(level)
        headers = {
            "x-ratelimit-limit-tokens": str(math.floor(burst * ratio)),
            "x-ratelimit-remaining-tokens": str(math.floor(level * ratio)),
            "x-ratelimit-reset-tokens": reset,
            "x-tokenfair-ratelimit-limit-service-tokens": str(limit_service),
            "x-tokenfair-ratelimit-remaining-service-tokens": str(remaining_service),
            "x-tokenfair-ratelimit-reset-service-tokens": reset,
        }
        if self.ietf:
            window_s = clock.real_seconds(burst * 1000.0 / sustained)
            headers.update(
                ietf_ratelimit_fields(limit_service, remaining_service, window_s, reset_s)
            )
        return headers
