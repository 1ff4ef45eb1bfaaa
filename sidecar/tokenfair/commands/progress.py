"""Progress bars for long runs (``simulate``, ``loadgen``, ``trace generate``, ``calibrate``).

A bar is drawn on stderr only when stderr is a terminal, ``--no-progress`` is not given and the
``CI`` environment variable is unset (or ``false``/``0``, as CI services set it to ``true``):
never in a pipe, a file or a CI log, even one on a pseudo-terminal, and never on stdout (which
carries the report). It is
drawn by tqdm, imported only when a bar is actually shown (``tokenfair simulate`` in a pipe does
not import it; ``tests/sidecar/cli/test_cli_imports.py``). Without tqdm installed the run goes on
without a bar. A bar is cleared from the terminal when its run ends (``leave=False``): what
stays is the report.

Hot loops pay nothing for a hidden bar (:meth:`Bar.iterate` returns the iterable itself) and,
for a shown one, one counter per item: the bar is updated every :data:`UPDATE_EVERY` items, not
per item.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, Final, TypeVar

T = TypeVar("T")

UPDATE_EVERY: Final = 1024
"""Items between two updates of a shown bar (the replay decides ~10^5 requests a second)."""


def add_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``--no-progress`` to a subcommand's parser."""
    parser.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="never draw a progress bar (one is drawn on stderr only when it is a terminal)",
    )


def wanted(args: argparse.Namespace) -> bool:
    """Whether a bar may be drawn: ``--no-progress`` not given, not in CI, stderr a terminal."""
    if not getattr(args, "progress", True):
        return False
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


class Bar:
    """A progress bar, or nothing (``Bar()``: every method is a no-op)."""

    __slots__ = ("_bar",)

    def __init__(self, bar: Any = None) -> None:
        self._bar = bar

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def update(self, count: int = 1) -> None:
        if self._bar is not None and count:
            self._bar.update(count)

    def set_total(self, total: int | None) -> None:
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def note(self, text: str, refresh: bool = False) -> None:
        """Show ``text`` after the counts (a phase, a live figure): at the next redraw, or now
        with ``refresh``."""
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=refresh)

    def iterate(self, items: Iterable[T], every: int = UPDATE_EVERY) -> Iterable[T]:
        """``items``, counting them on the bar every ``every`` items; ``items`` itself when no
        bar is shown (no wrapper in the loop)."""
        if self._bar is None:
            return items
        return self._counted(items, every)

    def _counted(self, items: Iterable[T], every: int) -> Iterator[T]:
        count = 0
        update = self._bar.update
        for item in items:
            yield item
            count += 1
            if count == every:
                update(count)
                count = 0
        if count:
            update(count)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bar(
    args: argparse.Namespace, description: str, total: int | None = None, unit: str = "req"
) -> Bar:
    """A bar on stderr when :func:`wanted`, else the no-op ``Bar()``."""
    if not wanted(args):
        return Bar()
    try:
        tqdm: Any = importlib.import_module("tqdm").tqdm
    except ImportError:  # a run without a bar rather than a failed run
        return Bar()
    return Bar(
        tqdm(
            total=total,
            desc=description,
            unit=unit,
            unit_scale=True,
            file=sys.stderr,
            leave=False,
            dynamic_ncols=True,
            mininterval=0.2,
        )
    )
