"""``tokenfair reasons``: every outcome reason, its status, gate, counter and meaning.

The reasons are :class:`tokenfair.core.reasons.Reason`'s members; ``--write`` makes the
generated blocks of the docs anew (``docs/records.md``'s table, ``docs/sidecar.md``'s label
values), which ``tests/sidecar/core/test_reasons.py`` checks against the enum.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tokenfair.commands import add_format_flag
from tokenfair.core.reasons import COUNTERS, Reason, markdown_table, update


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "reasons",
        help="list every outcome reason with its status, gate and meaning",
        description=(
            "Every reason a record, an access-log line, a 429's tokenfair_reason or a "
            "counter's label can carry: the status the client gets, the gate that produces "
            "it, the sidecar counter it is counted in and what it means. --write makes the "
            "generated blocks of the given docs anew."
        ),
    )
    add_format_flag(parser, "the Markdown table of the docs")
    parser.add_argument(
        "--write",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="regenerate the blocks between the reasons markers in each FILE (in place)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.write:
        for path in args.write:
            try:
                text = path.read_text(encoding="utf-8")
                new = update(text)
            except (OSError, ValueError) as exc:
                print(f"tokenfair reasons: --write {path}: {exc}", file=sys.stderr)
                return 2
            if new != text:
                path.write_text(new, encoding="utf-8")
                print(f"{path}: regenerated")
            else:
                print(f"{path}: up to date")
        return 0
    if args.format == "json":
        rows = [
            {
                "reason": reason.value,
                "status": reason.status,
                "gates": list(reason.gates),
                "counter": COUNTERS[reason.counter] or None,
                "meaning": reason.meaning,
            }
            for reason in Reason
        ]
        print(json.dumps(rows, indent=2))
    else:
        print(markdown_table(), end="")
    return 0
