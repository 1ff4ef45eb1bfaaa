"""The live fairness signal: each lane's service against the fluid fair-share reference over a
sliding window, for ``/metrics`` (``tokenfair_fluid_*``) and ``/status`` (``fairness``).

What it measures is the fairness report's fluid reference (docs/report.md; ``tokenfair
report`` computes it over a finished records file), kept up as requests end by
:class:`~tokenfair.sim.fluid_window.FluidWindow`: per lane, each tenant's service *received*
over the window against what a weighted max-min fluid server, given the lane's own service as
its capacity, would have delivered to the same arrivals::

    served_over_fluid(tenant) = received / reference          (over the window)
    jain(lane)  = (Σ x)² / (n · Σ x²)   over x = served_over_fluid of the lane's tenants with
                                         a reference > 0 in the window (1.0: every tenant got
                                         the same fraction of its fluid share; 1/n: one got all)
    worst(lane) = min x

The report's rules hold: a request's size is its settled (actual) service tokens where known,
else its estimate; a served request (the client met ``200`` at gate ``dispatch``) is demand
until the fluid server has served it, a cancelled one (``499``) until it left the queue, any
other — refused at the door, by its budget too, or shed from the queue — until its class's
wait limit. So a tenant held back by its own budget reads as under-served here: the reference
asks how the lane's service was split, not whether the split followed the budgets
(``tokenfair_refused_requests_total``'s ``reason`` says which gate refused it).

**Feed.** :meth:`Outcomes.completed <tokenfair.server.outcomes.Outcomes.completed>` calls
:meth:`FairnessSignal.completed` once per request that reached admission, with the outcome its
client met: O(log pending) (a heap push), never O(tenants), and it never raises.

**Refresh.** Every :data:`REFRESH_INTERVAL_S` real seconds the proxy app's task
(:meth:`FairnessSignal.run`) moves the fluid server to ``now - settle_ms`` and takes the
window's figures (O(tenants log tenants) per lane, and every ``window / 10`` of model time one
O(tenants) saving); ``/metrics`` and ``/status`` read those figures, so a scrape costs nothing
here. ``settle_ms`` — the longest wait limit plus 10 s — is how long a request may wait and run
before its outcome is final: the figures lag the clock by it, and a request that ends later (a
stream running for minutes) joins the fluid server late, counted in
``tokenfair_fluid_late_requests_total``.

**Bounds.** At most ``fairness_top_tenants`` tenants per lane are named in
``tokenfair_fluid_served_ratio``, the rest summed into ``tenant="other"``, whatever the number
of tenants (Jain and the worst ratio are over every tenant); memory is the fluid window's
(:mod:`tokenfair.sim.fluid_window`: eleven savings of two numbers per tenant, and the decisions
not yet settled, at most 100,000).

**Reload.** A config whose tenants (id, weight, lane) or whose ``serviceTokensPerMs`` and wait
limits differ from the running one starts the window afresh (its figures are empty until the
next refresh, and cover the time since the reload until a window has passed); other changes
(budgets, the KV geometry, the version) keep it.

Time is model milliseconds, the clock of the decisions (``now_ms`` is injected: the sidecar's
:class:`~tokenfair.server.clock.ModelClock`, a test's fake); the refresh task waits on an
:class:`~tokenfair.server.clock.EventClock` (by default the event loop's).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from typing import Final

from tokenfair.config import Config
from tokenfair.core import Decision
from tokenfair.server.clock import EventClock, ModelClock
from tokenfair.sim.fairness import decision_size
from tokenfair.sim.fluid_window import FluidWindow, WindowFairness

log = logging.getLogger("tokenfair.sidecar")

DEFAULT_WINDOW_S: Final = 300.0
"""Default of ``fairnessWindowSeconds``: 5 minutes of model time (real at ``timeScale`` 1).
Long enough that a lane serving a few requests a second holds hundreds of them, so that one
long generation landing in or out of the window does not read as unfairness; short enough that
an unfair split shows within minutes (the alert waits 15 more)."""
MIN_WINDOW_S: Final = 1.0
MAX_WINDOW_S: Final = 86_400.0
"""A day: the window's memory does not grow with its length (ten buckets), only its lag."""
DEFAULT_TOP_TENANTS: Final = 10
"""Default of ``fairnessTopTenants``: the tenants per lane named in the per-tenant ratio."""
MAX_TOP_TENANTS: Final = 100
"""At most 2 lanes x (100 + ``other``) per-tenant series, whatever the number of tenants."""
REFRESH_INTERVAL_S: Final = 5.0
"""Real seconds between two refreshes: below the usual 15-30 s scrape interval; each costs
~0.4 ms of event loop per 1,000 tenants (compiled core)."""

FairnessKey = tuple[float, float, float, tuple[tuple[str, float, str], ...]]


def fairness_key(config: Config) -> FairnessKey:
    """What of a config the fluid reference depends on: the lane's rate, the wait limits and
    each tenant's id, weight and lane (a reload that changes it starts a new window)."""
    policy = config.policy
    return (
        policy.service_tokens_per_ms,
        policy.max_interactive_wait_ms,
        policy.max_batch_wait_ms,
        tuple((t.tenant_id, t.weight, t.priority_class) for t in config.tenants),
    )


class FairnessSignal:
    """The sidecar's live fluid-reference fairness (module docstring). All methods run on the
    event-loop thread."""

    def __init__(
        self,
        config: Config,
        *,
        now_ms: Callable[[], float],
        window_s: float = DEFAULT_WINDOW_S,
        top_tenants: int = DEFAULT_TOP_TENANTS,
        refresh_interval_s: float = REFRESH_INTERVAL_S,
        clock: EventClock | None = None,
    ) -> None:
        if not MIN_WINDOW_S <= window_s <= MAX_WINDOW_S:
            raise ValueError(
                f"window_s must be in [{MIN_WINDOW_S:g}, {MAX_WINDOW_S:g}] (got {window_s!r})"
            )
        if not 0 <= top_tenants <= MAX_TOP_TENANTS:
            raise ValueError(f"top_tenants must be in [0, {MAX_TOP_TENANTS}] (got {top_tenants!r})")
        self.window_s = window_s
        self.top_tenants = top_tenants
        self.refresh_interval_s = refresh_interval_s
        self._now_ms = now_ms
        self._clock: EventClock = clock or ModelClock()
        """What :meth:`run` waits on between refreshes."""
        self._key = fairness_key(config)
        self._window = self._new_window(config)
        self._late_before = 0
        """Late requests of the windows a reload replaced (the counter never goes back)."""
        self.latest: WindowFairness | None = None
        """The figures of the last refresh (None before the first, and after a new window)."""
        self.refreshed_at_ms: float | None = None
        """The clock (model ms) of the last refresh."""

    def _new_window(self, config: Config) -> FluidWindow:
        return FluidWindow(config, window_ms=self.window_s * 1000.0, top_tenants=self.top_tenants)

    @property
    def settle_ms(self) -> float:
        """How far the fluid server runs behind the clock (module docstring)."""
        return self._window.settle_ms

    @property
    def late_requests(self) -> int:
        """Requests that ended after the fluid server had passed their arrival, since start."""
        return self._late_before + self._window.late_requests

    # -- feed ---------------------------------------------------------------------------------

    def completed(self, decision: Decision, status_code: int) -> None:
        """One request's end: its decision, with ``status_code`` the outcome its client met
        (a dispatched request the upstream failed is not served). Never raises."""
        try:
            if status_code != decision.status_code:  # rare: the outcome is not the core's
                decision = copy.copy(decision)
                decision.status_code = status_code
            self._window.observe(decision, decision_size(decision, None))
        except Exception:  # a bug: the signal misses one request, nothing else is touched
            log.exception("request %s: the fairness signal could not take it", decision.request_id)

    # -- refresh ------------------------------------------------------------------------------

    def refresh(self, now_ms: float | None = None) -> WindowFairness:
        """Move the fluid server to ``now_ms - settle_ms`` (default: the clock's now) and take
        the window's figures (:attr:`latest`)."""
        at_ms = self._now_ms() if now_ms is None else now_ms
        self._window.advance(at_ms)
        self.latest = self._window.snapshot()
        self.refreshed_at_ms = at_ms
        return self.latest

    async def run(self) -> None:
        """Refresh every :attr:`refresh_interval_s` real seconds until cancelled."""
        while True:
            await self._clock.sleep(self.refresh_interval_s)
            try:
                self.refresh()
            except Exception:  # a bug: logged; the last figures stay, the next tick tries again
                log.exception("refreshing the fairness signal failed")

    def reconfigure(self, config: Config) -> None:
        """A reloaded config: a new window if the fluid reference depends on what changed."""
        key = fairness_key(config)
        if key == self._key:
            return
        self._late_before += self._window.late_requests
        self._key = key
        self._window = self._new_window(config)
        self.latest = None
        self.refreshed_at_ms = None

    # -- /status ------------------------------------------------------------------------------

    def status(self) -> dict[str, object]:
        """The ``fairness`` entry of ``/status``: the settings, and the last refresh's figures
        (``window`` is null before the first)."""
        document: dict[str, object] = {
            "window_seconds": self.window_s,
            "settle_ms": self.settle_ms,
            "top_tenants": self.top_tenants,
            "refreshed_at_ms": self.refreshed_at_ms,
            "late_requests": self.late_requests,
        }
        latest = self.latest
        if latest is None or not math.isfinite(latest.end_ms):
            document["window"] = None
            return document
        lanes: dict[str, object] = {}
        for lane, figures in latest.lanes.items():
            worst = figures.worst
            lanes[lane] = {
                "jain": figures.jain,
                "worst": None
                if worst is None
                else {"tenant": worst.tenant_id, "served_over_fluid": worst.served_over_fluid},
                "tenants": [
                    {
                        "tenant": row.tenant_id,
                        "received_service_tokens": row.received_tokens,
                        "reference_service_tokens": row.reference_tokens,
                        "served_over_fluid": row.served_over_fluid,
                    }
                    for row in figures.tenants
                ],
            }
        document["window"] = {"start_ms": latest.start_ms, "end_ms": latest.end_ms, "lanes": lanes}
        return document
