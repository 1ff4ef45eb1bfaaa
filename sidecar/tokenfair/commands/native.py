"""``tokenfair native``: build the compiled core, or say whether this installation uses it.

The compiled core and its freshness rule are :mod:`tokenfair.native`'s (docs/native.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tokenfair import native


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "native",
        help="build the compiled core (mypyc), or say whether it is in use",
        description=(
            "The scheduling core and the replay loop compiled by mypyc are used only when "
            "built from exactly this installation's sources; otherwise the interpreted modules "
            "run (the same decisions, slower). 'build' compiles them (needs the dev extra's "
            "mypy and a C compiler; ~20 s); 'status' says whether this process uses them and, "
            f"if not, why. {native.SWITCH_ENV}=0 turns them off; {native.DIR_ENV} moves them."
        ),
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="{build,status}")
    build = actions.add_parser("build", help="compile the core into DIR (replacing a build)")
    build.add_argument(
        "--if-stale",
        action="store_true",
        help="do nothing if DIR holds a build of exactly these sources for this interpreter",
    )
    build.add_argument(
        "directory",
        type=Path,
        nargs="?",
        metavar="DIR",
        help=f"default: ${native.DIR_ENV}, else <sys.prefix>/tokenfair-native",
    )
    actions.add_parser(
        "status",
        help="say whether this process would use the compiled core, and why not; exit status "
        "0 if it would, 1 if not",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "status":
        status = native.status()
        print(status.describe())
        return 0 if status.active else 1
    directory = (args.directory or native.native_dir()).absolute()
    if args.if_stale:
        files, reason = native.check_build(directory)
        if files is not None:
            print(f"up to date: {directory}")
            return 0
        print(f"building: {reason}")
    try:
        native.build(directory)
    except (RuntimeError, OSError) as exc:
        print(f"tokenfair native build: {exc}", file=sys.stderr)
        return 1
    print(f"built {len(native.COMPILED)} modules into {directory}")
    return 0
