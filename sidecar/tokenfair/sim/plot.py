"""``--plot``: TTFT, admitted and refused service, and fairness per tenant, one column per policy.

The figure (one PNG) has a title, one column per policy (or recorded run) and up to three rows:

1. the TTFT distribution (CDF) of each tenant's admitted requests, on a log axis;
2. each tenant's admitted service tokens, with its refused ones (429s, sheds, expiries, client
   errors: every decision that was not served) stacked on top, hatched, and ``admitted/submitted``
   written above the bar;
3. with a fairness report: each tenant's served service tokens beside its fluid fair-share
   reference (an outlined bar) and its windowed max-min share (a dashed outline), Jain's index
   per lane against each in the panel's title.

Every panel of a row shares its axes with the others (a policy is compared at a glance, not by
reading tick labels). Each tenant keeps one colour, marker and line style in every panel, and one
legend above the panels names every tenant — also a tenant with no admitted request (it has no
CDF line; its bar says ``0/N``), so no tenant is hidden. The tenants named in that
legend are written into the PNG's ``Description`` text (what a test can read back).

matplotlib is an optional extra (``pip install 'tokenfair[plot]'``); without it the command says
how to get it instead of failing with an import error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from tokenfair.core import Decision
from tokenfair.sim.fairness import FairnessReport

if TYPE_CHECKING:  # matplotlib is imported lazily: it is an optional extra
    from matplotlib.axes import Axes

_BAR_WIDTH: Final = 0.4
_MARKERS: Final = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")
_LINESTYLES: Final = ("-", "--", "-.", ":")
_LEGEND_PREFIX: Final = "tenants: "


@dataclass(frozen=True, slots=True)
class TenantStyle:
    color: Any
    marker: str
    linestyle: Any


@dataclass(frozen=True, slots=True)
class PlotSummary:
    """What was drawn, read back from the figure: the tenants in its legend and each row's
    shared limits (``(low, high)`` per panel)."""

    title: str
    legend_tenants: tuple[str, ...]
    ttft_xlims: tuple[tuple[float, float], ...]
    service_ylims: tuple[tuple[float, float], ...]
    fairness_ylims: tuple[tuple[float, float], ...]
    fairness_titles: tuple[str, ...] = ()
    """Each fairness panel's title (Jain per lane against each reference)."""


def _styles(tenants: Sequence[str], colormap: Any) -> dict[str, TenantStyle]:
    """A distinct (colour, marker, line style) per tenant: 10 colours (20 past 10 tenants),
    12 hollow markers and 4 line styles, each cycling on its own, so no two of the first 60
    tenants look alike, and two tenants whose curves coincide still both show (a dashed line
    over a solid one, a hollow square around a hollow circle)."""
    colors = colormap("tab10" if len(tenants) <= 10 else "tab20").colors
    return {
        tenant: TenantStyle(
            colors[i % len(colors)],
            _MARKERS[i % len(_MARKERS)],
            _LINESTYLES[i % len(_LINESTYLES)],
        )
        for i, tenant in enumerate(tenants)
    }


def plot_report(
    results: Mapping[str, Sequence[Decision]],
    path: Path,
    fairness: Mapping[str, FairnessReport] | None = None,
    title: str = "tokenfair",
) -> PlotSummary:
    """Write the PNG (module docstring) and return what it shows."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers and CI
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib: pip install 'tokenfair[plot]' (or drop --plot)"
        ) from None
    tenants = sorted({d.tenant_id for decisions in results.values() for d in decisions})
    if fairness is not None:
        for report in fairness.values():
            tenants.extend(t for t in report.tenants if t not in tenants)
    styles = _styles(tenants, matplotlib.colormaps.get_cmap)
    columns = max(1, len(results))
    with_fairness = fairness is not None and any(p in fairness for p in results)
    rows = 3 if with_fairness else 2
    width = max(5.0, min(12.0, 0.45 * len(tenants)))
    figure, axes = plt.subplots(
        rows,
        columns,
        figsize=(width * columns, 3.6 * rows + 1.2),
        squeeze=False,
        sharex="row",
        sharey="row",
    )
    tops = [0.0] * rows  # the highest bar of each row
    for column, (policy, decisions) in enumerate(results.items()):
        per_tenant = _by_tenant(decisions, tenants)
        _ttft_panel(axes[0][column], policy, per_tenant, styles)
        tops[1] = max(tops[1], _service_panel(axes[1][column], per_tenant, styles))
        if with_fairness:
            assert fairness is not None
            policy_fairness = fairness.get(policy)
            if policy_fairness is None:
                axes[2][column].set_axis_off()
            else:
                top = _fairness_panel(axes[2][column], policy_fairness, tenants, styles)
                tops[2] = max(tops[2], top)
        if column == 0:
            axes[0][column].set_ylabel("fraction of admitted requests")
            axes[1][column].set_ylabel("service tokens")
            if with_fairness:
                axes[2][column].set_ylabel("service tokens (window)")
    handles = [
        Line2D(
            [],
            [],
            color=styles[t].color,
            marker=styles[t].marker,
            linestyle=styles[t].linestyle,
            markerfacecolor="none",
            label=_legend_label(t, fairness),
        )
        for t in tenants
    ]
    # Shared value axes from 0, with headroom for the counts above the bars and the legend.
    for row in range(1, rows):
        axes[row][0].set_ylim(0, (tops[row] or 1.0) * 1.22)
    legend_columns = min(len(tenants), max(1, int(width * columns // 3.2))) or 1
    legend_rows = -(-len(tenants) // legend_columns) if tenants else 1
    figure.suptitle(title, fontsize=12, fontweight="bold")
    legend = figure.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 0.965),
        ncol=legend_columns,
        fontsize=8,
        frameon=False,
    )
    top_inches = 0.35 + 0.18 * legend_rows
    figure.tight_layout(rect=(0, 0, 1, 1 - top_inches / figure.get_figheight()))
    summary = PlotSummary(
        title=title,
        legend_tenants=tuple(text.get_text().split(" (")[0] for text in legend.get_texts()),
        ttft_xlims=tuple(_limits(axes[0][c].get_xlim()) for c in range(columns)),
        service_ylims=tuple(_limits(axes[1][c].get_ylim()) for c in range(columns)),
        fairness_ylims=tuple(
            _limits(axes[2][c].get_ylim()) for c in range(columns) if with_fairness
        ),
        fairness_titles=tuple(axes[2][c].get_title() for c in range(columns) if with_fairness),
    )
    try:
        figure.savefig(
            path,
            dpi=100,
            metadata={
                "Title": title,
                "Description": _LEGEND_PREFIX + ", ".join(summary.legend_tenants),
            },
        )
    except OSError as exc:
        raise ValueError(f"--plot {path}: cannot write ({exc.strerror})") from None
    finally:
        plt.close(figure)
    return summary


def _legend_label(tenant: str, fairness: Mapping[str, FairnessReport] | None) -> str:
    """``tenant (lane, w=weight)`` when a fairness report knows the tenant, else ``tenant``."""
    for report in (fairness or {}).values():
        row = report.tenants.get(tenant)
        if row is not None:
            return f"{tenant} ({row.priority_class}, w={row.weight:g})"
    return tenant


def _limits(pair: tuple[float, float]) -> tuple[float, float]:
    return (float(pair[0]), float(pair[1]))


Split = tuple[list[Decision], list[Decision]]
"""A tenant's decisions: ``(admitted, refused)``."""


def _by_tenant(decisions: Sequence[Decision], tenants: Sequence[str]) -> dict[str, Split]:
    split: dict[str, Split] = {t: ([], []) for t in tenants}
    for decision in decisions:
        split[decision.tenant_id][0 if decision.admitted else 1].append(decision)
    return split


def _ttft_panel(
    axis: Axes, policy: str, per_tenant: Mapping[str, Split], styles: Mapping[str, TenantStyle]
) -> None:
    """TTFT CDF per tenant (log axis; TTFTs are clamped to 0.01 ms to be drawable)."""
    refused = sum(len(r) for _, r in per_tenant.values())
    total = sum(len(a) + len(r) for a, r in per_tenant.values())
    for tenant, (admitted, _) in per_tenant.items():
        ttfts = sorted(max(0.01, d.ttft_ms) for d in admitted)
        if not ttfts:
            continue
        style = styles[tenant]
        fractions = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        axis.step(
            ttfts,
            fractions,
            where="post",
            color=style.color,
            linestyle=style.linestyle,
            marker=style.marker,
            markerfacecolor="none",
            markersize=6,
            markeredgewidth=1.2,
            markevery=max(1, len(ttfts) // 8),
            linewidth=1.6,
            alpha=0.9,
        )
    axis.set_xscale("log")
    axis.set_ylim(0, 1.05)
    axis.grid(True, which="major", alpha=0.3)
    axis.set_title(f"{policy}\nadmitted {total - refused}/{total}, refused {refused}", fontsize=9)
    axis.set_xlabel("TTFT of admitted requests (ms, log scale)")


def _service_panel(
    axis: Axes, per_tenant: Mapping[str, Split], styles: Mapping[str, TenantStyle]
) -> float:
    """Admitted service tokens per tenant, refused ones stacked on top (hatched); returns the
    highest bar's top."""
    tenants = list(per_tenant)
    positions = range(len(tenants))
    admitted = [sum(d.service_tokens for d in per_tenant[t][0]) for t in tenants]
    refused = [sum(d.service_tokens for d in per_tenant[t][1]) for t in tenants]
    colors = [styles[t].color for t in tenants]
    axis.bar(positions, admitted, color=colors, edgecolor="black", linewidth=0.5)
    axis.bar(
        positions,
        refused,
        bottom=admitted,
        color="white",
        edgecolor=colors,
        hatch="///",
        linewidth=1.0,
    )
    for position, tenant, low, high in zip(positions, tenants, admitted, refused, strict=True):
        served, shed = per_tenant[tenant]
        axis.annotate(
            f"{len(served)}/{len(served) + len(shed)}",
            (position, low + high),
            xytext=(0, 2),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    axis.set_xticks(list(positions), tenants, rotation=20, fontsize=7, ha="right")
    axis.set_title("admitted (solid) and refused (hatched) service tokens", fontsize=8)
    return float(max((a + r for a, r in zip(admitted, refused, strict=True)), default=0))


def _fairness_panel(
    axis: Axes, report: FairnessReport, tenants: Sequence[str], styles: Mapping[str, TenantStyle]
) -> float:
    """Per tenant, in the tenants' order of the other rows: served (solid, the tenant's
    colour), its fluid reference (outlined) and its windowed max-min share (dashed outline)
    in service tokens; Jain per lane against each in the title. Returns the highest bar's
    top."""
    positions = range(len(tenants))
    rows = [report.tenants.get(t) for t in tenants]
    served = [0 if r is None else r.served_service_tokens for r in rows]
    fluid = [0.0 if r is None else r.fluid_reference_service_tokens for r in rows]
    fair = [0.0 if r is None else r.fair_share_service_tokens for r in rows]
    width = _BAR_WIDTH * 2 / 3
    axis.bar(
        [p - width for p in positions],
        served,
        width,
        color=[styles[t].color for t in tenants],
        edgecolor="black",
        linewidth=0.5,
        label="served",
    )
    axis.bar(positions, fluid, width, color="none", edgecolor="black", linewidth=1.0)
    axis.bar(
        [p + width for p in positions],
        fair,
        width,
        color="none",
        edgecolor="gray",
        linewidth=1.0,
        linestyle="--",
    )
    # Lane and weight are in the figure's legend.
    axis.set_xticks(list(positions), tenants, rotation=20, fontsize=7, ha="right")
    axis.set_title(_fairness_title(report), fontsize=8)
    from matplotlib.patches import Patch

    axis.legend(
        handles=[
            Patch(facecolor="lightgray", edgecolor="black", label="served (tenant's colour)"),
            Patch(facecolor="none", edgecolor="black", label="fluid reference"),
            Patch(facecolor="none", edgecolor="gray", linestyle="--", label="windowed share"),
        ],
        fontsize=7,
        loc="upper right",
    )
    return float(max([*served, *fluid, *fair], default=0))


def _fairness_title(report: FairnessReport) -> str:
    """Jain per lane against the fluid reference, then against the windowed share."""

    def by_lane(values: Mapping[str, float | None]) -> str:
        return ", ".join(
            f"{lane} {'-' if value is None else format(value, '.3f')}"
            for lane, value in values.items()
        )

    return (
        f"Jain vs fluid reference: {by_lane(report.fluid_jain_by_lane)}; "
        f"vs windowed share: {by_lane(report.jain_by_lane)}"
    )
