"""The loop of a validating read of a trace (:func:`records.stream_validated`), compiled.

:mod:`tokenfair.records.codec` owns the schema, the decoders and every error's wording; this
module holds only the per-line loop that a replay pays for at every request, so that it runs as
compiled code (docs/native.md) next to the replay that consumes it, rather than as an
interpreted generator resumed once a line (~3,000 instructions a line of interpreter work at
32k lines, measured under callgrind: ~5 % of a whole ``tokenfair simulate``).

Per line: decode it with the fast decoder (the required keys only, straight into a
``Request``); record its id's hash; check its tenant and its order; update the reading; yield
the arrival. Anything else — a line the fast decoder refuses (blank, observed or outcome keys,
or broken), an unknown tenant, a line out of order, a file that cannot be read, the checks at
the end — is handed to the :class:`ReadHooks` of the caller, which decodes, words and raises.

Repeated ids are found through their hashes (:class:`IdHashes`), 8 bytes a line.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Container, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Final, Protocol

import msgspec

from tokenfair.core.request import Request

Arrival = tuple[Request, int | None, int | None]
"""``(request, actual service tokens, actual KV blocks)``; the two are None without usage."""

_HASH_BITS: Final = (1 << 64) - 1
"""A ``hash`` as an unsigned 64-bit number. An unsigned array item is stored by a direct
conversion, a signed one through ``PyArg_Parse`` (~600 instructions an append, measured)."""
_HASH_TYPECODE: Final = "L" if array("L").itemsize == 8 else "Q"
"""``unsigned long`` where it has 64 bits (Linux, macOS): CPython converts an int to it digit
by digit, to ``unsigned long long`` through a byte array (~250 instructions, measured)."""


@dataclass(slots=True)
class TraceReading:
    """What a validating read has read so far; ``complete`` once it has read the whole file,
    every line valid (then the arrivals are the trace's)."""

    records: int = 0
    """The number of requests (set when the file has been read)."""
    first_arrival_ms: float = math.nan
    """The first line's ``arrival_ms`` (the smallest: the lines are in order)."""
    last_arrival_ms: float = math.nan
    """The latest line's ``arrival_ms`` (at the end: the largest)."""
    observed_usage: bool = False
    """Some line carries ``actual_prefill_tokens`` or ``actual_decode_tokens``."""
    complete: bool = False


class IdHashes:
    """The request ids read so far, 8 bytes each: their ``hash`` (unsigned), in 256 arrays by
    its low byte. A set of the ids themselves would keep every id string alive for the whole
    replay (~90 MB more at 1M requests); these arrays hold 8 MB. :meth:`repeated` is exact for
    repeated ids and may also answer true for two ids with one hash (odds ~n²/2⁶⁵): the caller
    then reads the file again to find the repeated id, or that there is none."""

    buckets: list[array[int]]
    _appends: list[Callable[[int], None]]

    def __init__(self) -> None:
        self.buckets = [array(_HASH_TYPECODE) for _ in range(256)]
        # Bound once: compiled, `bucket.append(x)` looks the method up by name at every call.
        self._appends = [bucket.append for bucket in self.buckets]

    def add(self, request_id: str) -> None:
        digest = hash(request_id)
        self._appends[digest & 255](digest & _HASH_BITS)

    def repeated(self) -> bool:
        """Two of the hashes are equal (checked one bucket at a time: a small set each)."""
        return any(len(set(bucket)) != len(bucket) for bucket in self.buckets)


class ReadHooks(Protocol):
    """What :func:`validated_arrivals` asks of its caller (each ``number`` is a 1-based line
    number). The ``*_error`` methods return the exception to raise (after checking, as the
    caller's rules say, whether a repeated id earlier in the file is the error to report)."""

    def open_file(self) -> AbstractContextManager[Iterator[bytes]]:
        """The trace's lines, opened for reading (each bounded in length: ``records.open_lines``);
        the hooks close the file when they are freed, should the reader be dropped before its
        end (a compiled generator runs no ``finally`` then)."""

    def other_line(self, line: bytes, number: int) -> Arrival | None:
        """A line the fast decoder refused: its arrival, None for a blank line; raises the
        line's error when it breaks the schema."""

    def tenant_error(self, request: Request, number: int) -> Exception: ...

    def order_error(self, request: Request, number: int) -> Exception: ...

    def read_error(self, error: OSError) -> Exception: ...

    def at_end(self, count: int) -> None:
        """The checks once the whole file has been read (raises their error)."""


def validated_arrivals(
    decode: Callable[[bytes], Request],
    known_tenants: Container[str],
    reading: TraceReading,
    ids: IdHashes,
    hooks: ReadHooks,
) -> Iterator[Arrival]:
    """The arrivals of the trace ``hooks.open_file()`` reads, validated as they are read, in
    file order, which must be ``(arrival_ms, request_id)`` order; ``reading`` is updated at each
    line and marked complete at the end (after ``hooks.at_end``). ``decode`` is the fast
    decoder's ``decode``: whatever it refuses (a ``msgspec.MsgspecError``) goes to
    ``hooks.other_line``."""
    previous_ms, previous_id = -math.inf, ""
    count = 0
    try:
        with hooks.open_file() as handle:
            number = 0
            for line in handle:
                number += 1
                arrival: Arrival | None = None
                try:
                    request = decode(line)
                except msgspec.MsgspecError:
                    arrival = hooks.other_line(line, number)
                    if arrival is None:
                        continue
                    request = arrival[0]
                request_id = request.request_id
                ids.add(request_id)
                if request.tenant_id not in known_tenants:
                    raise hooks.tenant_error(request, number)
                arrival_ms = request.arrival_ms
                if arrival_ms > previous_ms or (
                    arrival_ms == previous_ms and request_id > previous_id
                ):
                    previous_ms, previous_id = arrival_ms, request_id
                else:  # (an id equal to the one before at the same time is a repeated id)
                    raise hooks.order_error(request, number)
                if not count:
                    reading.first_arrival_ms = arrival_ms
                count += 1
                reading.last_arrival_ms = arrival_ms
                yield (request, None, None) if arrival is None else arrival
    except OSError as exc:
        raise hooks.read_error(exc) from None
    hooks.at_end(count)
    reading.records = count
    reading.complete = True
