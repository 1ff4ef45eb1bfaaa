"""Prometheus text format (0.0.4) for the families whose size grows with the tenants, written
directly and in bounded chunks, so that ``/metrics`` never holds the event loop for long.

``prometheus_client.generate_latest`` builds a ``Sample`` per line and formats each with a
generic routine; at 10,000 tenants (2,000 of them active) that was ~11 MB built in ~3.5 s in
one call on the proxy's event loop. Here each series carries its label text, escaped once when
the series is made, and a family is written as lines of that text and its numbers:
:func:`family_chunks` yields the family's text in chunks of at most ``per_chunk`` items, and the
admin handler yields to the event loop between chunks (:data:`COUNTER_CHUNK`,
:data:`HISTOGRAM_CHUNK` bound the work between two yields to ~1 ms). The text is what
``generate_latest`` writes for the same families, byte for byte (labels in name order, numbers
as Go writes them, ``_created`` samples as a ``gauge`` family of their own after the counter;
``tests/sidecar/server/test_sidecar_metrics.py`` compares them).

A scrape is not an atomic snapshot of every series (neither is ``prometheus_client``'s across
its collectors): each series' samples of one family are read together, so a histogram's
buckets, count and sum always agree, while two families may be read a few chunks apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Final, TypeVar

from prometheus_client.utils import floatToGoString

COUNTER_CHUNK: Final = 250
"""Series of a counter family (a line each) written between two yields (~0.5 ms)."""
HISTOGRAM_CHUNK: Final = 25
"""Series of a histogram family (~17 lines each) written between two yields (~0.5 ms)."""

_T = TypeVar("_T")


def label_value(value: str) -> str:
    """A label value escaped as the text format wants it (backslash, newline, double quote)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def number(value: float) -> str:
    """``value`` as Go (and ``prometheus_client``) writes a sample: ``3.0``, ``1.5e+06``,
    ``+Inf``. Integers below a million skip the general routine (the common case: counts)."""
    if type(value) is int and -1_000_000 < value < 1_000_000:
        return f"{value}.0"
    return go_float(value)


def go_float(value: float) -> str:
    """``prometheus_client``'s formatting of a sample value (Go's), typed."""
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]
    return text


def help_text(documentation: str) -> str:
    return documentation.replace("\\", r"\\").replace("\n", r"\n")


def family_chunks(
    name: str,
    kind: str,
    documentation: str,
    items: Sequence[_T],
    lines: Callable[[_T], str],
    per_chunk: int,
) -> Iterator[str]:
    """The family ``name`` of type ``kind`` (``# HELP``, ``# TYPE``, then ``lines(item)`` for
    each item), in chunks of at most ``per_chunk`` items; a family without items is its head
    alone, as ``generate_latest`` writes it."""
    head = f"# HELP {name} {help_text(documentation)}\n# TYPE {name} {kind}\n"
    if not items:
        yield head
        return
    for start in range(0, len(items), per_chunk):
        text = "".join([lines(item) for item in items[start : start + per_chunk]])
        yield head + text if start == 0 else text


def counter_chunks(
    name: str,
    documentation: str,
    items: Sequence[_T],
    totals: Callable[[_T], str],
    created: Callable[[_T], str] | None = None,
) -> Iterator[str]:
    """A counter family as ``generate_latest`` writes one: ``<name>_total`` (type
    ``counter``), then, if the samples carry ``created`` stamps and there are any samples, the
    ``<name>_created`` family (type ``gauge``, same help). ``totals`` and ``created`` give an
    item's lines of each: one, or (a counter by reason) as many as it has reasons, maybe none."""
    written = False

    def noted(item: _T) -> str:
        nonlocal written
        text = totals(item)
        written = written or bool(text)
        return text

    yield from family_chunks(f"{name}_total", "counter", documentation, items, noted,
                             COUNTER_CHUNK)  # fmt: skip
    if created is not None and written:
        yield from family_chunks(f"{name}_created", "gauge", documentation, items, created,
                                 COUNTER_CHUNK)  # fmt: skip
