"""docs/sidecar.md's table of ``sidecar:`` keys follows :class:`SidecarSettings`: every key, in
the dataclass's order, grouped by the same concerns (the one place a default is set)."""

from __future__ import annotations

import dataclasses
import re

from repo_paths import REPO_ROOT

from tokenfair.server.runtime_settings import SECTION_FIELDS, SidecarSettings

ROW = re.compile(r"^\| `([A-Za-z]+)` ")
GROUP = re.compile(r"^\| \*\*(.+)\*\* \|")
IN_CAPACITY_DOCS = {
    "engineMetricsPath",
    "engineMetricsIntervalSeconds",
    "engineMetricsStaleSeconds",
    "engineKvUsageMetric",
    "engineRunningMetric",
    "engineWaitingMetric",
    "adoptEngineKvGeometry",
    "kvPromptRatio",
    "kvDecodeBooking",
}
"""The engine's keys, which the table's ``engineMetrics`` row names and docs/capacity.md lists."""


def _table() -> list[tuple[str, str]]:
    """(group, key) of each row of the ``sidecar:`` table, in order."""
    text = (REPO_ROOT / "docs" / "sidecar.md").read_text()
    start = text.index("| `sidecar:` key")
    rows: list[tuple[str, str]] = []
    group = ""
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        if (heading := GROUP.match(line)) is not None:
            group = heading.group(1)
        elif (row := ROW.match(line)) is not None:
            rows.append((group, row.group(1)))
    return rows


def test_the_table_lists_every_key_in_the_settings_order() -> None:
    rows = _table()
    keys = [key for _, key in rows]
    assert set(keys) | IN_CAPACITY_DOCS == set(SECTION_FIELDS)
    assert not set(keys) & IN_CAPACITY_DOCS
    attrs = [SECTION_FIELDS[key][0] for key in keys]
    order = [field.name for field in dataclasses.fields(SidecarSettings)]
    assert attrs == [name for name in order if name in attrs]  # the dataclass's order
    assert all(group for group, _ in rows)  # every row under a concern's heading
    row = next(line for line in (REPO_ROOT / "docs" / "sidecar.md").read_text().splitlines()
               if line.startswith("| `engineMetrics` "))  # fmt: skip
    assert all(f"`{key}`" in row for key in IN_CAPACITY_DOCS)
