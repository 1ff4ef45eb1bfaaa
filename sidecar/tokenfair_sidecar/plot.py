"""``--plot``: TTFT distribution and admitted service per tenant, one column per policy.

matplotlib is an optional extra (``pip install 'tokenfair[plot]'``); without it the command says
how to get it instead of failing with an import error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from tokenfair_sidecar.core import Decision


def plot_report(results: Mapping[str, Sequence[Decision]], path: Path) -> None:
    """Write a PNG: top row TTFT CDF per tenant, bottom row admitted service tokens per tenant."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers and CI
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib: pip install 'tokenfair[plot]' (or drop --plot)"
        ) from None
    columns = len(results)
    figure, axes = plt.subplots(2, columns, figsize=(5 * columns, 7), squeeze=False)
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
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
