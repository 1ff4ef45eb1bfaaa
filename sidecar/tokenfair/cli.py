"""The ``tokenfair`` command line: one entry point, one module per subcommand.

Each module in :mod:`tokenfair.commands` exposes ``register(subparsers)``, which adds its
parser and sets ``func`` (``args -> exit code``). Only the module of the subcommand being run is
imported (the others get a parser that carries their one-line summary): ``tokenfair simulate``
must not pay for aiohttp, the server or loadgen. Errors a user can fix (bad config, bad trace,
bad flag) print one line to stderr and exit 2; an error of the system (``OSError``: a full disk)
one line and exit 1; nothing prints a traceback for them.
``tokenfair --version`` prints the installed distribution's version (its metadata, read only
when asked). :func:`main` first switches on the compiled core if a fresh build is there
(:func:`tokenfair.native.activate`; ``import tokenfair`` does not).

The console script is :func:`console`: :func:`main`, then the exit. For the subcommands of
:data:`FAST_EXIT` it flushes stdout and stderr and ends the process with ``os._exit``, skipping
the interpreter's teardown (freeing every module and object of a process about to end: ~15 ms
of a ~0.2 s ``tokenfair simulate``). Those commands close their own files before they return;
``atexit`` hooks are skipped (matplotlib's, after ``--plot``, only closes figures already
saved). :func:`main` itself always returns (tests call it in-process)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Collection, Sequence
from typing import Any, Final, NoReturn

from tokenfair import native
from tokenfair.commands import COMMANDS, load
from tokenfair.config import ConfigError

DISTRIBUTION: Final = "tokenfair"
FAST_EXIT: Final = frozenset({"simulate", "report"})
"""Subcommands with nothing left to clean up when they return: the console script ends them
without the interpreter's teardown (see the module's docstring)."""


class UsageError(Exception):
    """A problem with the command's inputs; the message says what to fix."""


def version() -> str:
    """The installed distribution's version, from its metadata (``importlib.metadata``)."""
    from importlib import metadata  # only for --version: it costs the other commands' start

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # imported from a source tree that is not installed
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """``--version``: print ``tokenfair X.Y.Z`` and exit 0 (argparse's own action needs the
    version string when the parser is built; this reads it only when the flag is given)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("help", "print the version and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog} {version()}")
        parser.exit()


def _chosen(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first argument that is not an option (the top-level
    parser has no option that takes a value), or None."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def build_parser(full: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The parser: each subcommand of ``full`` (default: every one) with its own options, the
    others with only their one-line summary (their modules are not imported)."""
    parser = argparse.ArgumentParser(
        prog="tokenfair",
        description="Fair admission and scheduling for shared LLM inference, in service tokens.",
    )
    parser.add_argument("--version", action=_VersionAction)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, entry in COMMANDS.items():
        if full is None or name in full:
            load(name).register(subparsers)
        else:
            subparsers.add_parser(name, help=entry.summary)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Before any subcommand imports the core: the compiled core if a fresh build is there
    # (tokenfair/native.py), else the interpreted one. The sidecar starts here too.
    native.activate()
    arguments = sys.argv[1:] if argv is None else list(argv)
    command = _chosen(arguments)
    # `tokenfair`, `tokenfair --help`, a typo: the summaries suffice.
    parser = build_parser(() if command is None else (command,))
    args = parser.parse_args(arguments)
    try:
        code: int = args.func(args)
    except (ConfigError, UsageError, ValueError) as exc:
        print(f"tokenfair {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `tokenfair simulate ... | head`
        return 0
    except OSError as exc:  # the system refused a write or a read: a full disk, a lost file
        print(f"tokenfair {args.command}: error: {exc}", file=sys.stderr)
        return 1
    return code


def console() -> NoReturn:
    """The ``tokenfair`` console script: exit with :func:`main`'s code; for a subcommand of
    :data:`FAST_EXIT`, once stdout and stderr are flushed, without the interpreter's teardown
    (a reader that closed the pipe early, as ``| head`` does, ends it with 0, as :func:`main`
    does)."""
    code = main()
    command = _chosen(sys.argv[1:])
    if command in FAST_EXIT:
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            pass
        except OSError as exc:  # e.g. a full disk: the report is incomplete
            print(f"tokenfair {command}: error: cannot write the output ({exc})", file=sys.stderr)
            code = code or 1
        try:
            sys.stderr.flush()
        finally:
            os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console()
