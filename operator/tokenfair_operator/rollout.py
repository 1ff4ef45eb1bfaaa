"""Propagation in status: how many of a policy's Ready sidecars run its published version.

Pure. Input: the ``/metrics`` text of each Ready sidecar the policy's selector matches (the
usage loop scrapes them anyway) and the version the operator published last. A sidecar runs
version ``v`` when its ``tokenfair_config_info`` gauge carries label ``version="v"``; one that
did not answer the scrape counts as not current. Output, written to ``SchedulingPolicy.status``:

* ``sidecarsReady`` — Ready sidecars (those asked);
* ``sidecarsCurrent`` — of them, those reporting the published version;
* ``sidecars`` — ``"<current>/<ready> @ <version>"``, the ``kubectl get tsp`` column: ``3/3``
  is a finished rollout; a number that stays behind is a stuck one (a sidecar refusing the
  document, or cut off from both the long-poll and its mounted file).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from prometheus_client.parser import text_string_to_metric_families

from tokenfair.config.wire import CONFIG_INFO_METRIC

CONFIG_INFO: Final = CONFIG_INFO_METRIC


def running_version(scrape: str) -> str | None:
    """The config version a sidecar's metrics text reports, or None if it reports none."""
    for family in text_string_to_metric_families(scrape):
        if family.name == CONFIG_INFO:
            for sample in family.samples:
                if sample.value == 1.0 and "version" in sample.labels:
                    return sample.labels["version"]
    return None


def rollout_status(ready: int, scrapes: Iterable[str], version: str) -> dict[str, Any]:
    """The three status fields for ``ready`` sidecars asked, from their answers."""
    current = sum(1 for scrape in scrapes if running_version(scrape) == version)
    return {
        "sidecarsReady": ready,
        "sidecarsCurrent": current,
        "sidecars": f"{current}/{ready} @ {version or '-'}",
    }


def rollout_changed(status: Mapping[str, Any], fresh: Mapping[str, Any]) -> bool:
    return any(status.get(key) != value for key, value in fresh.items())
