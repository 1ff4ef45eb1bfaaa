"""The state of one running sidecar, shared by the proxy and admin apps (``web.AppKey`` entries).

Owns the scheduler, its dispatcher, the authenticator and the accounting of outcomes (metrics,
per-tenant counters for ``/status``, request records). A request's one outcome is decided by
its :class:`~tokenfair.server.lifecycle.Lifecycle`, whose ``complete`` calls
:meth:`Sidecar.completed` for it once; :meth:`Sidecar.record` never raises (a record it cannot
write is counted as dropped). ``completed`` also writes the request's access-log line and, with
tracing on, its span (:meth:`Sidecar.observe`: never raises either); a request answered before
admission gets both from :meth:`Sidecar.observe_unadmitted`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import time
from collections import Counter
from pathlib import Path
from typing import Any, Final

from tokenfair.config import Config, PriorityClass
from tokenfair.config.budget_store import split_budgets
from tokenfair.core import (
    DEFAULT_POLICY,
    Decision,
    Lane,
    Request,
    Scheduler,
    make_scheduler,
)
from tokenfair.core.demand import DemandGauge
from tokenfair.core.jobs import LANE_OF, JobState
from tokenfair.core.tokenfair import TokenfairScheduler
from tokenfair.records.live import NO_USAGE, Usage, encode_record, minimal_record
from tokenfair.server.accesslog import (
    CURRENT_SCOPE,
    NO_FACTS,
    SERVED_FIELDS,
    AccessLog,
    LineWriter,
    RequestFacts,
    RequestScope,
    UtcTimestamps,
    bounded,
)
from tokenfair.server.auth import Authenticator
from tokenfair.server.backends import Backend, CostModelBackend, default_max_in_flight
from tokenfair.server.backends.base import UsageBounds
from tokenfair.server.connections import ConnectionCap
from tokenfair.server.dispatcher import Dispatcher, ModelClock
from tokenfair.server.engine_state import (
    EngineCollector,
    EngineLimits,
    EngineMetricNames,
    EngineReport,
    EngineState,
    LimitRefusal,
    asked_max_tokens,
    limit_refusal,
)
from tokenfair.server.errors import INTERNAL_ERROR
from tokenfair.server.estimate import ESTIMATORS, PromptEstimator
from tokenfair.server.fairness_signal import FairnessSignal
from tokenfair.server.kv_view import KvView, KvViewCollector
from tokenfair.server.metrics import (
    LANE_NAMES,
    DemandCollector,
    FluidFairnessCollector,
    LaneSeries,
    Metrics,
)
from tokenfair.server.pool import BudgetPool
from tokenfair.server.pool_fairness import PoolFairness
from tokenfair.server.record_writer import RecordWriter
from tokenfair.server.runtime_settings import LoadedFile, SidecarSettings
from tokenfair.server.tracing import RequestTracer, wall_ns_of

log = logging.getLogger("tokenfair.sidecar")

FALLBACK_RETRY_AFTER_S: Final = 1
"""``Retry-After`` when the gate gives no time (a request that can never fit as sized)."""
REFUSAL_STATUSES: Final = frozenset({400, 429, 503})
"""Statuses of a request never dispatched that count as refused (``400`` never admissible,
``429`` a gate, ``503`` draining); the same statuses after dispatch are the upstream's."""


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


class Sidecar:
    """One sidecar's live state; built by ``create_app``, torn down by its cleanup context."""

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
        self.clock = ModelClock(settings.time_scale)
        self.scheduler = make_scheduler(DEFAULT_POLICY, config, self.clock.now_ms())
        max_in_flight = settings.max_in_flight or default_max_in_flight(backend, config.policy)
        self.dispatcher = Dispatcher(self.scheduler, self.clock, max_in_flight)
        self.auth = Authenticator(config, settings.trusted_tenant_header)
        self.estimator: PromptEstimator = ESTIMATORS[settings.prompt_estimator]
        self.metrics = Metrics(self._scrape_state)
        self.fairness = FairnessSignal(
            config,
            now_ms=self.clock.now_ms,
            window_s=settings.fairness_window_s,
            top_tenants=settings.fairness_top_tenants,
        )
        """The live fluid-reference fairness (``tokenfair_fluid_*``), fed by :meth:`completed`
        and refreshed by the proxy app's task."""
        self.metrics.registry.register(FluidFairnessCollector(self.fairness))
        self.demand = DemandGauge(
            (config.policy.max_interactive_wait_ms, config.policy.max_batch_wait_ms),
            self.scheduler.cost.service_tokens_per_ms,
        )
        """The scaling signal's window (``tokenfair_demand_ratio``), fed by :meth:`admission`."""
        self.metrics.registry.register(DemandCollector(self.demand_ratios))
        self.pool: BudgetPool | None = None
        """Pool-wide budgets through the config's ``budgetStore``; None without one."""
        if config.budget_store is not None:
            scale = settings.time_scale
            self.pool = BudgetPool(
                config.budget_store,
                self.scheduler,
                wall_ms=lambda: time.time() * 1000.0 / scale,
                on_tokens=self.dispatcher.pump,
            )
            self.metrics.registry.register(self.pool.collector())
            self.metrics.add_tenant_families(self.pool.tenant_families)
        self.pool_fairness: PoolFairness | None = None
        """Pool-wide fair shares through the same store (``budgetStore.fairness``); None
        without a store, with ``fairness: false``, or under a policy that is not tokenfair."""
        if (
            self.pool is not None
            and config.budget_store is not None
            and config.budget_store.fairness
            and isinstance(self.scheduler, TokenfairScheduler)
        ):
            self.pool_fairness = PoolFairness(
                config.budget_store,
                self.scheduler,
                self.pool.client,
                monotonic_ms=lambda: time.monotonic() * 1000.0 / scale,
            )
            self.metrics.registry.register(self.pool_fairness.collector())
        self.budget_store_notice = ""
        """Why the budgets enforced differ from the document's until a restart ("" if not):
        a reload added, removed or moved the budget store (:meth:`_enforceable`)."""
        self.record_writer: RecordWriter | None = None
        self.tenant_counts: dict[str, Counter[str]] = {}
        self._series_cache: dict[tuple[str, PriorityClass], LaneSeries] = {}
        self._id_prefix = secrets.token_hex(4)
        self._next_id = 0
        self.access_log: AccessLog | None = (
            None if settings.access_log == "off" else AccessLog(settings.access_log, access_writer)
        )
        self._timestamps = UtcTimestamps()
        self.tracer: RequestTracer | None = None
        """Set by the app's tracing context when tracing is on."""
        self.usage_bounds = UsageBounds(settings.model_context_tokens)
        """The bounds reported usage is checked against (the one place that holds the model's
        context window: a later, better source of it updates this object)."""
        self.connections: ConnectionCap | None = None
        """The proxy listener's connection cap (set by ``runner.serve``; None in a test server
        without one)."""
        self.engine: EngineState | None = None
        """The poller of the upstream engine's own state (run by the app's engine context);
        None when off, or the backend has no engine to ask."""
        self.kv_view = KvView(
            follows_streams=type(backend).engine_get is not Backend.engine_get,
            books_prompt_ratio=settings.kv_prompt_ratio == "learned",
            clock=self.clock.now_ms,
        )
        """The running requests' progress: the engine's KV as the sidecar sees it (a backend
        with no engine behind it: the books), and the prompt ratio the gates book at."""
        self.metrics.registry.register(KvViewCollector(self.kv_view, lambda: self.scheduler))
        self._engine_geometry: tuple[int, int] | None = None
        """(block tokens, blocks) the engine reported, adopted over the policy's."""
        self._config_in_force = self.config
        self.engine_limits = EngineLimits()
        """What the engine said it serves (model context lengths, routes); empty until it says."""
        """The config given to the scheduler before the engine's geometry (:meth:`_enforce`)."""
        if settings.engine_metrics != "off" and type(backend).engine_get is not (
            Backend.engine_get
        ):
            custom = None
            if settings.engine_kv_usage_metric is not None:
                custom = EngineMetricNames(
                    kv_usage_ratio=(settings.engine_kv_usage_metric,),
                    running=tuple(filter(None, (settings.engine_running_metric,))),
                    waiting=tuple(filter(None, (settings.engine_waiting_metric,))),
                )
            self.engine = EngineState(
                backend.engine_get,
                engine=settings.engine_metrics,
                custom=custom,
                metrics_path=settings.engine_metrics_path,
                interval_s=settings.engine_metrics_interval_s,
                stale_s=settings.engine_metrics_stale_s,
                on_report=self._engine_report,
                on_stale=self._engine_stale,
                on_limits=self._engine_limits,
            )
            self.metrics.registry.register(EngineCollector(self.engine))

    def admission(self, request: Request, decision: Decision | None) -> None:
        """Admission decided ``request``: queued (``decision`` None) or refused (possibly in
        shadow mode); the scaling signal counts what was offered. Never raises."""
        try:
            if decision is None:
                tokens = self.scheduler.cost.service_tokens(
                    request.prefill_tokens, request.decode_tokens
                )
                self.demand.admitted(LANE_OF[request.priority_class], tokens, self.clock.now_ms())
            else:
                self.demand.refused(decision, self.clock.now_ms())
        except Exception:
            log.exception("request %s: the scaling signal failed to count it", request.request_id)

    def demand_ratios(self) -> dict[Lane, float]:
        """``tokenfair_demand_ratio`` per lane, now: the backlog read off the core's books."""
        scheduler = self.scheduler
        backlog = list(scheduler.queued_tokens)
        for job in scheduler.jobs.values():
            if job.state is JobState.DISPATCHED:
                backlog[job.lane] += job.service_tokens
        now_ms = self.clock.now_ms()
        return {
            lane: self.demand.ratio_of_backlog(lane, backlog[lane], now_ms) for lane in LANE_NAMES
        }

    def _scrape_state(self) -> tuple[Scheduler, bool, str, str]:
        return self.scheduler, self.dispatcher.draining, self.config.version, self.config_sha256

    def reopen_logs(self) -> None:
        """Reopen the files the sidecar appends to, at their paths: the records file
        (:meth:`RecordWriter.reopen <tokenfair.server.record_writer.RecordWriter.reopen>`;
        the access log goes to stdout, which the process does not own). For ``SIGHUP`` after
        log rotation. Never raises."""
        writer = self.record_writer
        if writer is not None:
            writer.reopen()

    def next_request_id(self) -> str:
        """Unique per process, and across restarts appending to one records file."""
        self._next_id += 1
        return f"{self._id_prefix}-{self._next_id:08d}"

    # -- reload ------------------------------------------------------------------------------

    def apply_config(self, loaded: LoadedFile) -> None:
        """Adopt a valid new config: queued and running requests keep going. A document whose
        budget store this sidecar cannot honour until a restart is enforced as it can
        (:meth:`_enforceable`) or refused (the last good config stays)."""
        config = loaded.config
        enforced, notice = self._enforceable(config)
        if enforced is None:
            self.budget_store_notice = notice
            self.refuse_config(notice)
            return
        self._enforce(enforced)
        if self.pool is not None:
            self.pool.adopt(enforced)
        if self.pool_fairness is not None and enforced.budget_store is not None:
            self.pool_fairness.adopt(enforced.budget_store)
            present = {tenant.tenant_id for tenant in config.tenants}
            before = {tenant.tenant_id for tenant in self.config.tenants}
            self.pool_fairness.forget(before - present, present)
        if notice:
            log.warning("config reload: %s", notice)
        self.budget_store_notice = notice
        self.auth = Authenticator(config, self.settings.trusted_tenant_header)
        if isinstance(self.backend, CostModelBackend):
            self.backend.retune(self.scheduler.cost)  # the policy's, as the scheduler prices
        if not self.settings.max_in_flight:  # the default follows maxBatchRequests
            self.dispatcher.max_in_flight = default_max_in_flight(self.backend, enforced.policy)
        self.config = config
        self.config_sha256 = loaded.sha256
        self.fairness.reconfigure(config)
        self.demand.retune(
            (enforced.policy.max_interactive_wait_ms, enforced.policy.max_batch_wait_ms),
            self.scheduler.cost.service_tokens_per_ms,
        )
        self.metrics.reloads.labels("applied").inc()
        if loaded.section != self.section:
            log.warning("config reload: the sidecar: section changed; restart to apply it")
        log.info("config reloaded: version %r, sha256 %s", config.version, loaded.sha256[:12])
        self.dispatcher.pump()

    # -- the engine's own state ---------------------------------------------------------------

    def _enforce(self, config: Config) -> None:
        """Give ``config`` to the scheduler, with the engine's KV geometry over the policy's
        while the engine reports it (``adoptEngineKvGeometry``)."""
        self._config_in_force = config
        geometry = self._engine_geometry
        if geometry is not None:
            block_tokens, blocks = geometry
            policy = dataclasses.replace(
                config.policy, kv_block_tokens=block_tokens, total_kv_blocks=blocks
            )
            config = dataclasses.replace(config, policy=policy)
        self.scheduler.reconfigure(config, self.clock.now_ms())

    def _engine_report(self, report: EngineReport) -> None:
        """A fresh report of the engine: its geometry adopted if it changed, its KV in use and
        its waiting requests given to the KV gates, and a pump (the view may have room)."""
        if (
            self.settings.adopt_engine_kv_geometry
            and report.block_size is not None
            and report.num_blocks is not None
            and (report.block_size, report.num_blocks) != self._engine_geometry
        ):
            policy = self._config_in_force.policy
            log.info("engine KV geometry: %d blocks of %d tokens (the config says %d of %d); "
                     "adopted", report.num_blocks, report.block_size, policy.total_kv_blocks,
                     policy.kv_block_tokens)  # fmt: skip
            self._engine_geometry = (report.block_size, report.num_blocks)
            self._enforce(self._config_in_force)
        scheduler = self.scheduler
        used = round(report.kv_usage_ratio * scheduler.policy.total_kv_blocks)
        running = None if report.running is None else int(report.running)
        self.kv_view.observe(scheduler, used, running, int(report.waiting or 0))
        if scheduler.queued_total:
            self.dispatcher.pump()

    def request_ended(
        self, request_id: str, estimated_prompt: int, reported_prompt: int | None
    ) -> None:
        """A request sent to the backend ended (``reported_prompt``: the prompt tokens the
        engine reported for it, None if none): the KV view forgets it and learns the prompt
        ratio, and the gates book the next admissions at the ratio it gives them."""
        view = self.kv_view
        view.forget(request_id, estimated_prompt, reported_prompt)
        self.scheduler.kv_prompt_ratio = view.gate_prompt_ratio

    def _engine_stale(self, problem: str) -> None:
        """No fresh report: the KV gates use the books alone (the geometry stays adopted)."""
        self.kv_view.observe(self.scheduler, None)

    def _engine_limits(self, limits: EngineLimits) -> None:
        """What the engine serves: its routes and context lengths, and the usage a report may
        claim follows the longest context it serves (its ``max_model_len``)."""
        self.engine_limits = limits
        if limits.max_model_len:
            self.usage_bounds.context_tokens = max(limits.max_model_len.values())

    def engine_refusal(self, path: str, body: dict[str, Any]) -> LimitRefusal | None:
        """A request the engine would refuse for certain (:func:`~tokenfair.server.
        engine_state.limit_refusal`), answered before admission; None otherwise."""
        limits = self.engine_limits
        if limits.routes is None and not limits.max_model_len:
            return None
        return limit_refusal(limits, path, body.get("model"), asked_max_tokens(body))

    def _enforceable(self, config: Config) -> tuple[Config | None, str]:
        """What of ``config`` this running sidecar enforces, and why it differs (or "").

        The store's connection (and the lease client) is made at start only, and a document's
        budgets are the pool's with a store but one sidecar's share without one. So:

        * started without a store, the document adds one: its budgets are the pool's, and no
          lease client runs here; each tenant gets ``split_budgets(tenant, replicas)`` (the
          store's fallback split) on a local bucket, until a restart;
        * started with a store, the document removes it: its budgets are one sidecar's share,
          wrong for the running pool; refused (None), the last good config stays;
        * the store's identity (url, passwordEnv, keyPrefix) changes: the budgets are still
          the pool's; the running store keeps serving them (its replicas and lease settings
          follow the document), until a restart;
        * ``fairness`` flips: the fair shares' task is made at start only; the running mode
          (pool-wide or per sidecar) stays, until a restart.
        """
        new = config.budget_store
        pool = self.pool
        if pool is None:
            if new is None:
                return config, ""
            shares = tuple(split_budgets(tenant, new.replicas) for tenant in config.tenants)
            return dataclasses.replace(config, tenants=shares, budget_store=None), (
                f"budgetStore added ({new.url}, key prefix {new.key_prefix!r}) but this sidecar "
                f"started without one: each tenant's pool budget is enforced here as "
                f"1/{new.replicas} on a local bucket until the sidecar is restarted"
            )
        running = pool.store
        if new is None:
            return None, (
                f"budgetStore removed, but this sidecar leases from {running.url} (key prefix "
                f"{running.key_prefix!r}) and the document's budgets are per-sidecar shares; "
                "reload refused, the last good config and its pool stay until the sidecar is "
                "restarted"
            )
        notices: list[str] = []
        if new.fairness != running.fairness:
            notices.append(
                f"budgetStore.fairness changed to {str(new.fairness).lower()}; this sidecar keeps "
                f"fairness: {str(running.fairness).lower()} until it is restarted"
            )
            new = dataclasses.replace(new, fairness=running.fairness)
        identity = (running.url, running.password_env, running.key_prefix)
        if (new.url, new.password_env, new.key_prefix) != identity:
            notices.append(
                f"budgetStore changed to {new.url} (key prefix {new.key_prefix!r}); this sidecar "
                f"keeps leasing from {running.url} (key prefix {running.key_prefix!r}) until it "
                "is restarted"
            )
            new = dataclasses.replace(
                new,
                url=running.url,
                password_env=running.password_env,
                key_prefix=running.key_prefix,
            )
        if not notices:
            return config, ""
        return dataclasses.replace(config, budget_store=new), "; ".join(notices)

    def refuse_config(self, message: str) -> None:
        self.metrics.reloads.labels("invalid").inc()
        log.error("config reload refused, keeping the last good config: %s", message)

    def reload_failed(self, message: str) -> None:
        """Count a reload that failed unexpectedly (the watcher logged it, with its traceback,
        and tries again on its next tick)."""
        self.metrics.reloads.labels("error").inc()

    # -- outcomes ----------------------------------------------------------------------------

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

    def ratelimit_headers(
        self, tenant_id: str, mix: tuple[int, int] | None = None
    ) -> dict[str, str]:
        """Rate-limit headers from the tenant's bucket (service tokens, see the docs):

        * ``x-tokenfair-ratelimit-{limit,remaining,reset}-service-tokens``: the bucket exactly
          (burst, level, real seconds until full);
        * ``x-ratelimit-{limit,remaining,reset}-tokens`` (OpenAI's names) in the tokens clients
          count (``usage.prompt_tokens + usage.completion_tokens``): the bucket converted with
          this request's own mix, ``usage / service`` where ``mix = (usage, service)`` is its
          estimate's ``prompt + max_tokens`` and service tokens (floored); without ``mix``, or
          for a request of 0 service tokens, 1:1;
        * with ``ietf_ratelimit_headers``, ``RateLimit-Policy`` and ``RateLimit``
          (:func:`ietf_ratelimit_fields`)."""
        state = self.scheduler.tenants.get(tenant_id)
        if state is None:
            return {}
        bucket = state.bucket
        level = bucket.refill(self.clock.now_ms())
        reset_ms = max(0.0, bucket.burst - level) * 1000.0 / bucket.sustained_per_second
        level = max(0.0, level)  # a bucket in debt shows 0 remaining (the reset counts the debt)
        reset_s = self.clock.real_seconds(reset_ms)
        usage, service = mix if mix is not None else (1, 1)
        ratio = usage / service if service > 0 else 1.0
        headers = {
            "x-ratelimit-limit-tokens": str(math.floor(bucket.burst * ratio)),
            "x-ratelimit-remaining-tokens": str(math.floor(level * ratio)),
            "x-ratelimit-reset-tokens": f"{reset_s:.3f}s",
            "x-tokenfair-ratelimit-limit-service-tokens": str(math.floor(bucket.burst)),
            "x-tokenfair-ratelimit-remaining-service-tokens": str(math.floor(level)),
            "x-tokenfair-ratelimit-reset-service-tokens": f"{reset_s:.3f}s",
        }
        if self.settings.ietf_ratelimit_headers:
            window_s = self.clock.real_seconds(bucket.burst * 1000.0 / bucket.sustained_per_second)
            headers.update(
                ietf_ratelimit_fields(
                    math.floor(bucket.burst), math.floor(level), window_s, reset_s
                )
            )
        return headers

    def _series(self, tenant_id: str, priority_class: PriorityClass) -> LaneSeries:
        key = (tenant_id, priority_class)
        series = self._series_cache.get(key)
        if series is None:
            lane = LANE_NAMES[Lane.of(priority_class)]
            series = self._series_cache[key] = self.metrics.lane_series(tenant_id, lane)
        return series

    def dispatched(self, decision: Decision) -> None:
        series = self._series(decision.tenant_id, decision.priority_class)
        series.admitted += 1
        series.estimated_tokens += decision.service_tokens
        series.queue_wait.observe(decision.queue_wait_ms / 1000.0)

    def completed(
        self,
        request: Request,
        decision: Decision,
        *,
        status_code: int,
        reason: str,
        actual_service_tokens: int | None = None,
        usage: Usage | None = None,
        facts: RequestFacts | None = None,
    ) -> None:
        """Count, measure and record one request's outcome, then log and trace it and give it to
        the fairness signal (called once per request, by :meth:`Lifecycle.complete
        <tokenfair.server.lifecycle.Lifecycle.complete>`). A failure while counting (a bug,
        logged) does not stop the record, nor a failure of either the log line or the span."""
        if usage is None:
            usage = NO_USAGE
        try:
            self._count(request, decision, status_code, reason, actual_service_tokens, usage)
        except Exception:
            log.exception("request %s: counting its outcome failed; its record is still written",
                          request.request_id)  # fmt: skip
        self.record(request, decision, status_code=status_code, reason=reason, usage=usage)
        self.observe(request, decision, status_code=status_code, reason=reason,
                     actual_service_tokens=actual_service_tokens, usage=usage,
                     facts=facts)  # fmt: skip
        self.fairness.completed(decision, status_code)  # never raises

    def _count(
        self,
        request: Request,
        decision: Decision,
        status_code: int,
        reason: str,
        actual_service_tokens: int | None,
        usage: Usage,
    ) -> None:
        tenant = request.tenant_id
        series = self._series(tenant, request.priority_class)
        counts = self.tenant_counts.get(tenant)
        if counts is None:
            counts = self.tenant_counts[tenant] = Counter()
        if status_code == 499:
            series.cancelled += 1
            counts["cancelled"] += 1
        elif decision.dispatch_ms is None and status_code in REFUSAL_STATUSES:
            # Never dispatched: refused at admission (429, or 400 never admissible), shed from
            # the queue (429) or taken out of it by a drain (503 draining). A dispatched
            # request's 400, 429 or 503 is the upstream's answer, not a refusal.
            series.count_refused(reason)
            counts["refused"] += 1
        elif reason.startswith("upstream_") or reason == INTERNAL_ERROR or status_code >= 500:
            # Upstream faults (502, 504, a stream cut after its 200, usage not believed on a
            # 200, the upstream's own 5xx), the sidecar's own failures (500 internal_error, or
            # a 200 it could not settle) and requests the drain cut (503 drain_aborted).
            series.count_backend_error(reason)
            counts["backend_errors"] += 1
        else:
            counts["served"] += 1
        if decision.would_refuse:
            series.count_would_refuse(decision.reason)
            counts["would_refuse"] += 1
        if decision.dispatch_ms is not None:
            counts["admitted"] += 1
            settled = (
                decision.service_tokens
                if actual_service_tokens is None
                else (actual_service_tokens)
            )
            series.actual_tokens += settled
            if usage.prompt_tokens is not None:
                series.prompt_tokens += usage.prompt_tokens
            if usage.completion_tokens is not None:
                series.completion_tokens += usage.completion_tokens
            e2e_ms = usage.e2e_ms
            if e2e_ms is None:
                e2e_ms = self.clock.now_ms() - request.arrival_ms
            series.e2e.observe(e2e_ms / 1000.0)
        if usage.ttft_ms is not None:
            series.observe_ttft(usage.ttft_ms / 1000.0)
            decision.ttft_ms = round(usage.ttft_ms, 2)

    # -- access log and tracing --------------------------------------------------------------

    def observe(
        self,
        request: Request,
        decision: Decision,
        *,
        status_code: int,
        reason: str,
        actual_service_tokens: int | None = None,
        usage: Usage = NO_USAGE,
        facts: RequestFacts | None = None,
    ) -> None:
        """Write the request's access-log line and, with tracing on, its span
        (:mod:`~tokenfair.server.accesslog`, :mod:`~tokenfair.server.tracing`),
        and mark its scope accounted. Never raises."""
        scope = CURRENT_SCOPE.get()
        if scope is not None:
            scope.accounted = True
        access, tracer = self.access_log, self.tracer
        if (access is None or not access.enabled()) and tracer is None:
            return
        try:
            facts = facts or NO_FACTS
            clock = self.clock
            now_ms = clock.now_ms()
            scale = clock.time_scale
            settled = 0
            if decision.dispatch_ms is not None:  # it ran
                settled = (
                    decision.service_tokens
                    if actual_service_tokens is None
                    else actual_service_tokens
                )
            e2e_model_ms = usage.e2e_ms if usage.e2e_ms is not None else now_ms - request.arrival_ms
            ttft_ms = usage.ttft_ms
            now_s = time.time()
            values = (
                self._timestamps(now_s),
                request.request_id,
                request.tenant_id,
                request.priority_class,
                scope.method if scope is not None else "POST",
                bounded(facts.route) or (scope.route if scope is not None else None),
                bounded(facts.model),
                status_code,
                reason,
                decision.gate,
                request.prefill_tokens,
                request.decode_tokens,
                decision.service_tokens,
                usage.prompt_tokens,
                usage.completion_tokens,
                settled,
                round(decision.queue_wait_ms * scale, 3),
                None if ttft_ms is None else round(ttft_ms * scale, 3),
                round(e2e_model_ms * scale, 3),
            )
        except Exception:
            log.exception("request %s: building its access log line failed", request.request_id)
            return
        if access is not None:
            access.emit_served(values)
        if tracer is not None:
            try:
                now_ns = int(now_s * 1e9)
                tracer.request_span(
                    dict(zip(SERVED_FIELDS, values, strict=True)), request, decision, facts,
                    start_ms=request.arrival_ms if scope is None else scope.arrival_ms,
                    now_ms=now_ms, now_ns=now_ns, time_scale=scale, scope=scope,
                )  # fmt: skip
            except Exception:
                log.exception("request %s: its span failed", request.request_id)

    def observe_unadmitted(self, scope: RequestScope, status_code: int, reason: str | None
                           ) -> None:  # fmt: skip
        """The access-log line and span of a request answered before admission (by the
        proxy app's middleware: nothing accounted it). Never raises."""
        access, tracer = self.access_log, self.tracer
        if (access is None or not access.enabled()) and tracer is None:
            return
        try:
            now_ms = self.clock.now_ms()
            now_s = time.time()
            fields: dict[str, Any] = {
                "time": self._timestamps(now_s),
                "request_id": None,
                "tenant": None,
                "priority_class": None,
                "method": scope.method,
                "route": scope.route,
                "model": None,
                "status": status_code,
                "reason": reason,
                "e2e_ms": round((now_ms - scope.arrival_ms) * self.clock.time_scale, 3),
            }
        except Exception:
            log.exception("an unadmitted request's access log line failed")
            return
        if access is not None:
            access.emit(fields)
        if tracer is not None:
            try:
                now_ns = int(now_s * 1e9)
                start = wall_ns_of(scope.arrival_ms, now_ms, now_ns, self.clock.time_scale)
                tracer.span(fields, start_ns=start, end_ns=now_ns, events=[],
                            traceparent=scope.traceparent, tracestate=scope.tracestate)  # fmt: skip
            except Exception:
                log.exception("an unadmitted request's span failed")

    def record(
        self,
        request: Request,
        decision: Decision | None,
        *,
        status_code: int,
        reason: str,
        usage: Usage = NO_USAGE,
    ) -> None:
        """Write the request's record, if records are on. Never raises: a record that cannot
        be encoded, or has no decision (which cannot happen: the lifecycle logs it), is written
        minimal (:func:`minimal_record`), and one that cannot be queued at all is counted in
        ``tokenfair_records_dropped_total`` (both logged)."""
        writer = self.record_writer
        if writer is None:
            return
        try:
            line: str | None = None
            if decision is not None:
                try:
                    line = encode_record(request, decision, self.policy_name,
                                         status_code=status_code, reason=reason,
                                         usage=usage)  # fmt: skip
                except Exception:
                    log.exception("request %s: its record could not be encoded; writing a "
                                  "minimal one", request.request_id)  # fmt: skip
            if line is None:
                line = minimal_record(request, self.policy_name, status_code=status_code,
                                      reason=reason)  # fmt: skip
            writer.write(line)
        except Exception:
            log.exception("request %s: its record could not be written; counted as dropped",
                          request.request_id)  # fmt: skip
            try:
                self.metrics.records_dropped.inc()
            except Exception:
                log.exception("counting a dropped record failed")
