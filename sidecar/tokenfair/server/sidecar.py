"""The composition root of one running sidecar, shared by the proxy and admin apps
(``web.AppKey`` entries): it builds the parts and wires them, and holds no logic of its own.

The parts: the scheduler and its :class:`~tokenfair.server.dispatcher.Dispatcher`; the
:class:`~tokenfair.server.outcomes.Outcomes` sink (metrics series, per-tenant counters for
``/status``, records, access log, tracing, the fairness and scaling signals: never raises);
the :class:`~tokenfair.server.ratelimit.RateLimits` (rate-limit headers and ``Retry-After``);
the :class:`~tokenfair.server.engine_link.EngineLink` (the engine's own state given to the
gates); the pool-wide budgets and fair shares. A request's
:class:`~tokenfair.server.lifecycle.Lifecycle` sees only :attr:`Sidecar.ports`
(:class:`~tokenfair.server.lifecycle.RequestPorts`). The reload plan is
:func:`tokenfair.server.reload.apply_config`; ``/status`` is rendered by
:mod:`tokenfair.server.status`.
"""

from __future__ import annotations

import itertools
import secrets
import time
from pathlib import Path

from tokenfair.config import Config
from tokenfair.core import DEFAULT_POLICY, Lane, Scheduler, make_scheduler
from tokenfair.core.demand import DemandGauge
from tokenfair.core.tokenfair import TokenfairScheduler
from tokenfair.server.accesslog import AccessLog, LineWriter
from tokenfair.server.auth import Authenticator
from tokenfair.server.backends import Backend, default_max_in_flight
from tokenfair.server.backends.base import UsageBounds
from tokenfair.server.clock import ModelClock
from tokenfair.server.connections import ConnectionCap
from tokenfair.server.dispatcher import Dispatcher
from tokenfair.server.engine_link import EngineLink
from tokenfair.server.engine_state import (
    EngineCollector,
    EngineMetricNames,
    EngineState,
    fresh_at_most_s,
)
from tokenfair.server.estimate import ESTIMATORS, PromptEstimator
from tokenfair.server.fairness_signal import FairnessSignal
from tokenfair.server.kv_view import KvView, KvViewCollector
from tokenfair.server.lifecycle import RequestPorts
from tokenfair.server.metrics import (
    LANE_NAMES,
    DemandCollector,
    FluidFairnessCollector,
    Metrics,
)
from tokenfair.server.outcomes import Outcomes
from tokenfair.server.pool import BudgetPool
from tokenfair.server.pool_fairness import PoolFairness
from tokenfair.server.ratelimit import RateLimits
from tokenfair.server.runtime_settings import SidecarSettings


class Sidecar:
    """One sidecar's parts, wired; built by ``create_app``, torn down by its cleanup context."""

    def __init__(
        self,
        settings: SidecarSettings,
        config: Config,
        backend: Backend,
        *,
        config_sha256: str = "",
        config_path: Path | None = None,
        section: object = None,
        access_writer: LineWriter | None = None,
    ) -> None:
        if settings.prompt_estimator not in ESTIMATORS:
            raise ValueError(
                f"unknown prompt estimator {settings.prompt_estimator!r} "
                f"(known: {', '.join(ESTIMATORS)})"
            )
        self.settings = settings
        self.config = config
        self.config_sha256 = config_sha256
        self.config_path = config_path
        self.section = section or {}
        self.backend = backend
        self.policy_name = DEFAULT_POLICY
        self.clock = clock = ModelClock(settings.time_scale)
        self.scheduler = scheduler = make_scheduler(DEFAULT_POLICY, config, clock.now_ms())
        max_in_flight = settings.max_in_flight or default_max_in_flight(backend, config.policy)
        self.dispatcher = dispatcher = Dispatcher(scheduler, clock, max_in_flight)
        self.auth = Authenticator(config, settings.trusted_tenant_header)
        self.estimator: PromptEstimator = ESTIMATORS[settings.prompt_estimator]
        self.metrics = metrics = Metrics(self._scrape_state)
        self.fairness = FairnessSignal(
            config,
            now_ms=clock.now_ms,
            window_s=settings.fairness_window_s,
            top_tenants=settings.fairness_top_tenants,
        )
        """The live fluid-reference fairness (``tokenfair_fluid_*``), fed by the outcome sink
        and refreshed by the proxy app's task."""
        metrics.registry.register(FluidFairnessCollector(self.fairness))
        self.demand = DemandGauge(
            (config.policy.max_interactive_wait_ms, config.policy.max_batch_wait_ms),
            scheduler.cost.service_tokens_per_ms,
        )
        """The scaling signal's window (``tokenfair_demand_ratio``), fed at admission."""
        metrics.registry.register(DemandCollector(self.demand_ratios))

        access_log = None if settings.access_log == "off" else AccessLog(settings.access_log,
                                                                         access_writer)  # fmt: skip
        self.outcomes = Outcomes(metrics, clock, self.fairness, self.demand, scheduler,
                                 access_log, self.policy_name)  # fmt: skip
        self.ports = RequestPorts(
            dispatcher=dispatcher,
            now_ms=clock.now_ms,
            backend=backend,
            pricing=scheduler,
            outcomes=self.outcomes,
        )
        """All a request's :class:`~tokenfair.server.lifecycle.Lifecycle` sees of the sidecar."""
        self.ratelimits = RateLimits(scheduler, clock, ietf=settings.ietf_ratelimit_headers)
        self.pool: BudgetPool | None = None
        """Pool-wide budgets through the config's ``budgetStore``; None without one."""
        scale = settings.time_scale
        if config.budget_store is not None:
            self.pool = BudgetPool(
                config.budget_store,
                scheduler,
                wall_ms=lambda: time.time() * 1000.0 / scale,
                on_tokens=dispatcher.pump,
            )
            metrics.registry.register(self.pool.collector())
            metrics.add_tenant_families(self.pool.tenant_families)
        self.pool_fairness: PoolFairness | None = None
        """Pool-wide fair shares through the same store (``budgetStore.fairness``); None
        without a store, with ``fairness: false``, or under a policy that is not tokenfair."""
        if (
            self.pool is not None
            and config.budget_store is not None
            and config.budget_store.fairness
            and isinstance(scheduler, TokenfairScheduler)
        ):
            self.pool_fairness = PoolFairness(
                config.budget_store,
                scheduler,
                self.pool.client,
                clock=clock,  # fairnessSyncMs in model ms, probeIntervalMs in real ms: its own
            )
            metrics.registry.register(self.pool_fairness.collector())
        self.budget_store_notice = ""
        """Why the budgets enforced differ from the document's until a restart ("" if not):
        a reload added, removed or moved the budget store (``reload.enforceable``)."""
        self.id_prefix = secrets.token_hex(4)
        self.id_counter = itertools.count(1)
        """Request ids ``<id_prefix>-<counter:08d>``: unique per process, and across restarts
        appending to one records file (made by the proxy)."""
        self.usage_bounds = UsageBounds(settings.model_context_tokens)
        """The bounds reported usage is checked against (the one place that holds the model's
        context window: a later, better source of it updates this object)."""
        self.connections: ConnectionCap | None = None
        """The proxy listener's connection cap (set by ``runner.serve``; None in a test server
        without one)."""
        has_engine = type(backend).engine_get is not Backend.engine_get
        self.kv_view = KvView(
            follows_streams=has_engine,
            books_prompt_ratio=settings.kv_prompt_ratio == "learned",
            clock=clock.now_ms,
            decode_booking=settings.kv_decode_booking,
            stale_after_ms=1000.0
            * fresh_at_most_s(settings.engine_metrics_interval_s, settings.engine_metrics_stale_s),
        )
        """The running requests' progress: the engine's KV as the sidecar sees it (a backend
        with no engine behind it: the books), and the prompt ratio the gates book at."""
        metrics.registry.register(KvViewCollector(self.kv_view, lambda: scheduler))
        self.engine_link = EngineLink(scheduler, config, self.kv_view, self.usage_bounds,
                                      now_ms=clock.now_ms, pump=dispatcher.pump,
                                      adopt_geometry=settings.adopt_engine_kv_geometry)  # fmt: skip
        self.engine: EngineState | None = None
        """The poller of the upstream engine's own state (run by the app's engine context);
        None when off, or the backend has no engine to ask."""
        if settings.engine_metrics != "off" and has_engine:
            custom = None
            if settings.engine_kv_usage_metric is not None:
                custom = EngineMetricNames(
                    kv_usage_ratio=(settings.engine_kv_usage_metric,),
                    running=tuple(filter(None, (settings.engine_running_metric,))),
                    waiting=tuple(filter(None, (settings.engine_waiting_metric,))),
                )
            link = self.engine_link
            self.engine = EngineState(
                backend.engine_get,
                engine=settings.engine_metrics,
                custom=custom,
                metrics_path=settings.engine_metrics_path,
                interval_s=settings.engine_metrics_interval_s,
                stale_s=settings.engine_metrics_stale_s,
                on_report=link.report,
                on_stale=link.stale,
                on_limits=link.adopt_limits,
            )
            metrics.registry.register(EngineCollector(self.engine))

    def demand_ratios(self) -> dict[Lane, float]:
        """``tokenfair_demand_ratio`` per lane, now: the backlog the core reports (queued and
        dispatched, not yet settled)."""
        scheduler = self.scheduler
        running = scheduler.running_backlog()
        now_ms = self.clock.now_ms()
        return {
            lane: self.demand.ratio_of_backlog(
                lane, scheduler.queued_tokens[lane] + running[lane], now_ms
            )
            for lane in LANE_NAMES
        }

    def _scrape_state(self) -> tuple[Scheduler, bool, str, str]:
        return self.scheduler, self.dispatcher.draining, self.config.version, self.config_sha256

    def reopen_logs(self) -> None:
        """Reopen the files the sidecar appends to, at their paths: the records file
        (:meth:`RecordWriter.reopen <tokenfair.server.record_writer.RecordWriter.reopen>`;
        the access log goes to stdout, which the process does not own). For ``SIGHUP`` after
        log rotation. Never raises."""
        writer = self.outcomes.record_writer
        if writer is not None:
            writer.reopen()
