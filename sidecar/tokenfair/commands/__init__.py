"""Subcommands of ``tokenfair``; each module has ``register(subparsers)``.

The modules are imported lazily, one per run: :data:`COMMANDS` names each subcommand's module
and its one-line summary (what ``tokenfair --help`` lists), so ``tokenfair simulate`` never
imports what only the sidecar or loadgen need (aiohttp, the server, the HTTP client).
``tests/sidecar/cli/test_cli_imports.py`` checks both: the summaries against each module's own
``help``, and the modules a real ``tokenfair simulate`` run loads.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Final, NamedTuple


class Command(NamedTuple):
    """A subcommand: its module (under this package) and its one-line summary."""

    module: str
    summary: str


COMMANDS: Final[dict[str, Command]] = {
    "simulate": Command(
        "simulate", "replay a workload under one or more policies and compare them"
    ),
    "loadgen": Command(
        "loadgen", "replay a workload against a live OpenAI-compatible endpoint (the sidecar)"
    ),
    "trace": Command("trace", "make request traces"),
    "calibrate": Command(
        "calibrate",
        "fit the cost model (a batching engine's, from records under load) to "
        "observed request times",
    ),
    "report": Command(
        "report",
        "per-tenant fairness of recorded decisions: served vs a fluid fair-share reference",
    ),
    "sidecar": Command(
        "sidecar", "run the admission and fair-scheduling proxy in front of one model server"
    ),
    "native": Command("native", "build the compiled core (mypyc), or say whether it is in use"),
    "reasons": Command("reasons", "list every outcome reason with its status, gate and meaning"),
}
"""Every subcommand by name, in the order ``tokenfair --help`` lists them."""


def load(name: str) -> ModuleType:
    """Import the module of subcommand ``name`` (a key of :data:`COMMANDS`)."""
    return importlib.import_module(f"{__name__}.{COMMANDS[name].module}")


FORMATS: Final = ("table", "json")
"""Every subcommand's ``--format`` vocabulary."""
DEPRECATED_FORMATS: Final = {"text": "table"}
"""Old spellings still accepted (with a warning on stderr), so scripts keep working."""


class _FormatAction(argparse.Action):
    """Stores the format, turning a deprecated spelling into its name with a warning."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        value = str(values)
        if value in DEPRECATED_FORMATS:
            value = DEPRECATED_FORMATS[value]
            print(
                f"{parser.prog}: warning: --format {values} is deprecated; use --format {value}",
                file=sys.stderr,
            )
        setattr(namespace, self.dest, value)


def add_format_flag(parser: argparse.ArgumentParser, table: str = "fixed-width tables") -> None:
    """``--format table|json`` (default table); ``text`` is a deprecated alias of ``table``."""
    parser.add_argument(
        "--format",
        action=_FormatAction,
        choices=(*FORMATS, *DEPRECATED_FORMATS),
        default="table",
        metavar="{" + ",".join(FORMATS) + "}",
        help=f"table: {table} (default); json: one JSON document. "
        f"{', '.join(DEPRECATED_FORMATS)}: deprecated alias of table",
    )
