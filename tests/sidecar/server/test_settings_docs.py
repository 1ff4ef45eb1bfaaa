"""docs/sidecar.md's table of ``sidecar:`` keys follows :class:`SidecarSettings`: every key, in
the dataclass's order, under the heading of its group (the ``# -- <group>`` comments of the
class), with the dataclass's default and the flag ``tokenfair sidecar`` reads for it."""

from __future__ import annotations

import dataclasses
import inspect
import re

from repo_paths import REPO_ROOT

from tokenfair.commands.sidecar import _FLAGS, flag_name
from tokenfair.server.runtime_settings import SECTION_FIELDS, SidecarSettings

ROW = re.compile(r"^\| `([A-Za-z]+)` +\| ([^|]*)\| ([^|]*)\|")
GROUP_ROW = re.compile(r"^\| \*\*(.+)\*\* \|")
GROUP_COMMENT = re.compile(r"^    # -- (.+?) -+$")
FIELD = re.compile(r"^    ([a-z_]+): ")
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
DESCRIBED_DEFAULTS = {"maxInFlight"}
"""Keys whose default the table describes in words (it depends on the backend and policy)."""


def _table() -> list[tuple[str, str, str, str]]:
    """(group, key, flag cell, default cell) of each row of the ``sidecar:`` table, in order."""
    text = (REPO_ROOT / "docs" / "sidecar.md").read_text()
    start = text.index("| `sidecar:` key")
    rows: list[tuple[str, str, str, str]] = []
    group = ""
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        if (heading := GROUP_ROW.match(line)) is not None:
            group = heading.group(1)
        elif (row := ROW.match(line)) is not None:
            rows.append((group, row.group(1), row.group(2).strip(), row.group(3).strip()))
    return rows


def _field_groups() -> dict[str, str]:
    """Each field of :class:`SidecarSettings` -> the ``# -- <group>`` comment above it."""
    groups: dict[str, str] = {}
    group = ""
    for line in inspect.getsource(SidecarSettings).splitlines():
        if (comment := GROUP_COMMENT.match(line)) is not None:
            group = comment.group(1)
        elif (field := FIELD.match(line)) is not None:
            groups[field.group(1)] = group
    return groups


def _shows(cell: str, default: object) -> bool:
    """Whether a default cell states ``default``."""
    shown = cell.split("`")[1] if cell.count("`") >= 2 else cell
    if default is None:
        return cell.startswith("—") or cell == "off"
    if isinstance(default, bool):
        return shown == str(default).lower()
    if isinstance(default, int | float):
        return float(shown) == default
    if isinstance(default, tuple):
        return shown == "[" + ", ".join(default) + "]"
    return shown == default


def test_the_table_lists_every_key_in_the_settings_order_and_groups() -> None:
    rows = _table()
    keys = [key for _, key, _, _ in rows]
    assert set(keys) | IN_CAPACITY_DOCS == set(SECTION_FIELDS)
    assert not set(keys) & IN_CAPACITY_DOCS
    attrs = [SECTION_FIELDS[key][0] for key in keys]
    order = [field.name for field in dataclasses.fields(SidecarSettings)]
    assert attrs == [name for name in order if name in attrs]  # the dataclass's order
    groups = _field_groups()
    assert set(groups) == set(order)
    assert all(groups.values())
    for heading, key, _, _ in rows:  # the table's heading: the group's name, or its start
        assert heading, key
        assert groups[SECTION_FIELDS[key][0]].startswith(heading), (key, heading)
    row = next(line for line in (REPO_ROOT / "docs" / "sidecar.md").read_text().splitlines()
               if line.startswith("| `engineMetrics` "))  # fmt: skip
    assert all(f"`{key}`" in row for key in IN_CAPACITY_DOCS)


def test_the_table_states_each_default_and_flag() -> None:
    defaults = {field.name: field.default for field in dataclasses.fields(SidecarSettings)}
    flags = {key: dest for dest, key in _FLAGS.items()}
    for _, key, flag_cell, default_cell in _table():
        if key not in DESCRIBED_DEFAULTS:
            assert _shows(default_cell, defaults[SECTION_FIELDS[key][0]]), (key, default_cell)
        if key in flags:
            flag = flag_name(flags[key])
            spelled = (flag, flag.replace("--", "--[no-]", 1))  # a boolean flag has both
            assert any(re.search(f"`{re.escape(f)}[ `]", flag_cell) for f in spelled), key
        else:
            assert flag_cell == "—", key
