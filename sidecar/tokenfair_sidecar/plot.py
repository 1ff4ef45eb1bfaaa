"""``--plot``: TTFT distribution, admitted service and fairness per tenant, one column per policy.

matplotlib is an optional extra (``pip install 'tokenfair[plot]'``); without it the command says
how to get it instead of failing with an import error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenfair_sidecar.core import Decision
from tokenfair_sidecar.fairness import FairnessReport

if TYPE_CHECKING:  # matplotlib is imported lazily: it is an optional extra
    from matplotlib.axes import Axes

_BAR_WIDTH = 0.4


def plot_report(
    results: Mapping[str, Sequence[Decision]],
    path: Path,
    fairness: Mapping[str, FairnessReport] | None = None,
) -> None:
    """Write a PNG: top row TTFT CDF per tenant, middle row admitted service tokens per tenant,
    and with ``fairness`` (by policy, as ``results``) a bottom row of served service tokens
    beside the weighted max-min fair share per tenant (``fairness.py``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers and CI
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib: pip install 'tokenfair[plot]' (or drop --plot)"
        ) from None
    columns = len(results)
    rows = 2 if fairness is None else 3
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.5 * rows), squeeze=False)
    tenants = sorted({d.tenant_id for decisions in results.values() for d in decisions})
    for column, (policy, decisions) in enumerate(results.items()):
        cdf, bars = axes[0][column], axes[1][column]
        served = []
        for tenant_id in tenants:
            ttfts = sorted(d.ttft_ms for d in decisions if d.tenant_id == tenant_id and d.admitted)
            if ttfts:
                fractions = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
                cdf.step(ttfts, fractions, where="post", label=tenant_id)
            served.append(
                sum(d.service_tokens for d in decisions if d.tenant_id == tenant_id and d.admitted)
            )
        cdf.set_title(policy, fontsize=9)
        cdf.set_xlabel("TTFT (ms)")
        cdf.set_ylabel("fraction of admitted requests")
        cdf.legend(fontsize=7)
        bars.bar(range(len(tenants)), served)
        bars.set_xticks(range(len(tenants)), tenants, rotation=20, fontsize=7)
        bars.set_ylabel("admitted service tokens")
        if fairness is not None and policy in fairness:
            _fairness_panel(axes[2][column], fairness[policy])
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _fairness_panel(axis: Axes, report: FairnessReport) -> None:
    """Served vs fair-share service tokens per tenant, side by side; Jain per lane in the title."""
    rows = list(report.tenants.values())
    positions = range(len(rows))
    axis.bar(
        [p - _BAR_WIDTH / 2 for p in positions],
        [t.served_service_tokens for t in rows],
        _BAR_WIDTH,
        label="served",
    )
    axis.bar(
        [p + _BAR_WIDTH / 2 for p in positions],
        [t.fair_share_service_tokens for t in rows],
        _BAR_WIDTH,
        label="max-min fair share",
    )
    labels = [f"{t.tenant_id}\n({t.priority_class}, w={t.weight:g})" for t in rows]
    axis.set_xticks(list(positions), labels, rotation=20, fontsize=7)
    axis.set_ylabel("service tokens (window)")
    jain = ", ".join(
        f"{lane} {'-' if value is None else format(value, '.3f')}"
        for lane, value in report.jain_by_lane.items()
    )
    axis.set_title(f"served vs fair share; Jain {jain}", fontsize=8)
    axis.legend(fontsize=7)
