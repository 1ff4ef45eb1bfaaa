"""What the upstream engine says, given to the scheduler: its KV geometry adopted over the
policy's (``adoptEngineKvGeometry``), its KV in use and waiting requests to the KV gates
through the KV view, its served models' context lengths to the usage bounds and the refusals
answered before admission.

:class:`EngineLink` receives the reports of :class:`~tokenfair.server.engine_state.EngineState`
(its ``on_report``, ``on_stale`` and ``on_limits``) and answers, before admission, a request
the engine's limits refuse (:meth:`EngineLink.refusal`); it is also where a config is given to
the scheduler (:meth:`EngineLink.enforce`), since the geometry in force depends on both. The
end of each request sent to the backend goes to the KV view itself (:meth:`KvView.request_ended
<tokenfair.server.kv_view.KvView.request_ended>`), which learns from it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from tokenfair.config import Config
from tokenfair.core import Scheduler
from tokenfair.server.backends.base import UsageBounds
from tokenfair.server.engine_state import (
    EngineLimits,
    EngineReport,
    LimitRefusal,
    asked_max_tokens,
    limit_refusal,
)
from tokenfair.server.kv_view import KvView

log = logging.getLogger("tokenfair.sidecar")


class EngineLink:
    """The engine's own state as the scheduler's gates and the proxy use it."""

    def __init__(
        self,
        scheduler: Scheduler,
        config: Config,
        kv_view: KvView,
        usage_bounds: UsageBounds,
        *,
        now_ms: Callable[[], float],
        pump: Callable[[], None],
        adopt_geometry: bool,
    ) -> None:
        self.scheduler = scheduler
        self.kv_view = kv_view
        self.usage_bounds = usage_bounds
        self._now_ms = now_ms
        self._pump = pump
        self._adopt_geometry = adopt_geometry
        self._config_in_force = config
        """The config given to the scheduler before the engine's geometry (:meth:`enforce`)."""
        self._geometry: tuple[int, int] | None = None
        """(block tokens, blocks) the engine reported, adopted over the policy's."""
        self.limits = EngineLimits()
        """What the engine said it serves (model context lengths, routes); empty until it says."""

    def enforce(self, config: Config) -> None:
        """Give ``config`` to the scheduler, with the engine's KV geometry over the policy's
        while the engine reports it (``adoptEngineKvGeometry``)."""
        self._config_in_force = config
        geometry = self._geometry
        if geometry is not None:
            block_tokens, blocks = geometry
            policy = dataclasses.replace(
                config.policy, kv_block_tokens=block_tokens, total_kv_blocks=blocks
            )
            config = dataclasses.replace(config, policy=policy)
        self.scheduler.reconfigure(config, self._now_ms())

    def report(self, report: EngineReport) -> None:
        """A fresh report of the engine: its geometry adopted if it changed, its KV in use and
        its waiting requests given to the KV gates, and a pump (the view may have room)."""
        if (
            self._adopt_geometry
            and report.block_size is not None
            and report.num_blocks is not None
            and (report.block_size, report.num_blocks) != self._geometry
        ):
            policy = self._config_in_force.policy
            log.info("engine KV geometry: %d blocks of %d tokens (the config says %d of %d); "
                     "adopted", report.num_blocks, report.block_size, policy.total_kv_blocks,
                     policy.kv_block_tokens)  # fmt: skip
            self._geometry = (report.block_size, report.num_blocks)
            self.enforce(self._config_in_force)
        scheduler = self.scheduler
        used = round(report.kv_usage_ratio * scheduler.policy.total_kv_blocks)
        running = None if report.running is None else int(report.running)
        self.kv_view.observe(scheduler, used, running, int(report.waiting or 0))
        if scheduler.queued_total:
            self._pump()

    def stale(self, problem: str) -> None:
        """No fresh report: the KV gates use the books alone (the geometry stays adopted)."""
        self.kv_view.observe(self.scheduler, None)

    def adopt_limits(self, limits: EngineLimits) -> None:
        """What the engine serves: its routes and context lengths, and the usage a report may
        claim follows the longest context it serves (its ``max_model_len``)."""
        self.limits = limits
        if limits.max_model_len:
            self.usage_bounds.context_tokens = max(limits.max_model_len.values())

    def refusal(self, path: str, body: dict[str, Any]) -> LimitRefusal | None:
        """A request the engine would refuse for certain (:func:`~tokenfair.server.
        engine_state.limit_refusal`), answered before admission; None otherwise."""
        limits = self.limits
        if limits.routes is None and not limits.max_model_len:
            return None
        return limit_refusal(limits, path, body.get("model"), asked_max_tokens(body))
