"""The ``tokenfair`` command line: one entry point, one module per subcommand.

Each module in :mod:`tokenfair_sidecar.commands` exposes ``register(subparsers)``, which adds its
parser and sets ``func`` (``args -> exit code``). Errors a user can fix (bad config, bad trace, bad
flag) print one line to stderr and exit 2; nothing prints a traceback for them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tokenfair_sidecar.commands import COMMANDS
from tokenfair_sidecar.config import ConfigError


class UsageError(Exception):
    """A problem with the command's inputs; the message says what to fix."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenfair",
        description="Fair admission and scheduling for shared LLM inference, in service tokens.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except (ConfigError, UsageError, ValueError) as exc:
        print(f"tokenfair {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `tokenfair simulate ... | head`
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
