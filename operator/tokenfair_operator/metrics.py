"""The operator's own Prometheus metrics (served on ``/metrics`` by :mod:`.serve`).

* ``tokenfair_operator_pods_without_sidecar{namespace, policy}`` — labelled Pods of a policy
  running without the sidecar (they serve every tenant unadmitted); alert on ``> 0``.
* ``tokenfair_operator_sidecars{namespace, policy, state}`` — the policy's Ready sidecars
  (``state="current"``: reporting the published config version; ``"stale"``: another one or
  none yet), from their ``/status``.
* ``tokenfair_operator_reconcile_seconds`` — histogram of one reconcile pass.

One registry per :class:`OperatorMetrics` (no process-global state), so tests build their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

PASS_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Reconcile-pass histogram buckets in seconds: a pass of 10,000 quotas with nothing to write
takes ~1 s (``bench/bench_operator_scale.py``); the issue's budget is 5 s."""


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.pods_without_sidecar = Gauge(
            "tokenfair_operator_pods_without_sidecar",
            "Pods labelled tokenfair.io/policy that run without the tokenfair sidecar.",
            ["namespace", "policy"],
            registry=self.registry,
        )
        self.sidecars = Gauge(
            "tokenfair_operator_sidecars",
            "Ready sidecars of a policy by whether they run the published config version.",
            ["namespace", "policy", "state"],
            registry=self.registry,
        )
        self.reconcile_seconds = Histogram(
            "tokenfair_operator_reconcile_seconds",
            "Duration of one reconcile pass of one SchedulingPolicy.",
            buckets=PASS_BUCKETS_S,
            registry=self.registry,
        )

    def exposition(self) -> bytes:
        """The text exposition format of every metric."""
        return generate_latest(self.registry)
