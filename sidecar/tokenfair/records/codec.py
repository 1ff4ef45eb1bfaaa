"""Request records (JSONL): the trace format the simulator replays and the sidecar writes.

One JSON object per line. The schema is :class:`TraceLine`, written once and decoded by a
compiled decoder (msgspec; ~0.7 µs a line, validated): required ``request_id`` (str),
``tenant_id`` (str), ``arrival_ms`` (number >= 0 and <= 1e15), ``prefill_tokens`` and
``decode_tokens`` (int >= 0), ``priority_class`` (``interactive|batch``); optional observed fields
``actual_prefill_tokens``, ``actual_decode_tokens`` (what the backend reported), ``ttft_ms`` and
``e2e_ms`` (observed times). Outcome fields of a decision record (``status_code``, ``reason``,
``queue_wait_ms``, …, see :data:`OUTCOME_FIELDS`) may be present and are skipped, so a
sidecar's records replay as they are. Any other key is an error. Errors name ``file:line``, the
field and the rule (:func:`_trace_error` rewords the decoder's). Schema: docs/records.md.

Reading: :func:`read_trace` (a list), :func:`iter_trace_lines` (a validated stream),
:func:`scan_trace` (one validating pass, nothing kept but the ids), :func:`stream_validated`
(one validating pass that yields the replay's arrivals as it reads: the first replay of
``tokenfair simulate``) and :func:`stream_requests` (a validated file straight into ``Request``
objects, for the later replays; :func:`stream_arrivals` the same as the replay's arrivals).

Writing: every record line of the project is written here, by one encoder. A request record
is a :class:`TraceLine` (:func:`dump_trace`: ``tokenfair trace generate``), a decision record a
:class:`RecordLine` (the ``Decision``'s fields, then the request fields of a live record):
``tokenfair simulate --records`` (:func:`encode_decision`), the sidecar's records file
(``records/live.py``, written by ``server/record_writer.py``) and ``tokenfair loadgen
--records`` (``loadgen.record_line``) all build one with :func:`decision_line` and write it
with :func:`encode_record_line`. The encoding
rule is ``json.dumps`` compact (ASCII only); :func:`plain_line` applies it plainly (the
reference) and the encoders apply it fast (msgspec, checked byte for byte against it). Decision
records are read back into ``Decision`` objects by :func:`read_decisions` (``tokenfair report``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import operator
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final, TextIO, TypeVar, cast, get_args

import msgspec

from tokenfair.config import PRIORITY_CLASSES, PriorityClass, shown
from tokenfair.config.files import InputFileError, open_regular
from tokenfair.core import Decision, Request
from tokenfair.core.cost import service_tokens
from tokenfair.records.reading import IdHashes, validated_arrivals
from tokenfair.records.reading import TraceReading as TraceReading  # re-exported: part of the API
from tokenfair.records.schema import MAX_RECORD_MS as MAX_RECORD_MS
from tokenfair.records.schema import RecordLine as RecordLine
from tokenfair.records.schema import TraceLine as TraceLine
from tokenfair.records.schema import TraceRequest as TraceRequest

# ---------------------------------------------------------------------------------------------
# The request record schema: one definition, read by a compiled decoder (msgspec).

_TRACE_FIELDS: Final = msgspec.structs.fields(TraceLine)
REQUIRED_FIELDS: Final = tuple(f.name for f in _TRACE_FIELDS if f.required)
OBSERVED_FIELDS: Final = tuple(f.name for f in _TRACE_FIELDS if not f.required)
OUTCOME_FIELDS: Final = frozenset(f.name for f in dataclasses.fields(Decision)) | {
    "policy",
    "estimated_service_tokens",
}
"""Decision-record fields a request record may carry (ignored on replay)."""

# The wire type adds the outcome-only fields as `Raw`: accepted, never decoded (no cost beyond
# skipping them). Built from `Decision`'s fields so a new outcome field replays at once.
_TraceWire = msgspec.defstruct(
    "_TraceWire",
    [
        (name, msgspec.Raw, msgspec.Raw())
        for name in sorted(OUTCOME_FIELDS - set(REQUIRED_FIELDS) - set(OBSERVED_FIELDS))
    ],
    bases=(TraceLine,),
    forbid_unknown_fields=True,
    frozen=True,
    gc=False,
)
_DECODER: Final = msgspec.json.Decoder(cast(type[TraceLine], _TraceWire))
_REQUEST_LINE_DECODER: Final = msgspec.json.Decoder(TraceRequest)
"""The fast path of :func:`stream_validated`: a line with the required keys only. Whatever it
refuses goes to :data:`_DECODER`, which accepts it (observed or outcome keys) or words the
error; what it accepts, :data:`_DECODER` accepts too (the same rules, fewer keys)."""


class TraceError(ValueError):
    """A trace line broke the schema; the message names the file, line and field."""


MAX_LINE_BYTES: Final = 1 << 20
"""Longest line read from a records file (1 MiB; a record is a few hundred bytes). A line is
read at most this far (plus its newline): a longer one — a 100 MB one-line file, a file with
no newline at all — is refused at its first MiB, never held whole (:func:`too_long`)."""


class RecordLines:
    """A records file's lines, as bytes, each read with ``readline(MAX_LINE_BYTES + 1)``: a
    longer line comes in pieces, the first of which its reader refuses (:func:`too_long`).
    ``with`` gives the lines (a C-level iterator: ``iter(partial(readline, n), b"")``, ~70 ns a
    line over a plain file iteration); :meth:`close` closes the file."""

    __slots__ = ("handle",)

    def __init__(self, handle: BinaryIO) -> None:
        self.handle = handle

    def __enter__(self) -> Iterator[bytes]:
        return iter(functools.partial(self.handle.readline, MAX_LINE_BYTES + 1), b"")

    def __exit__(self, *exc: object) -> None:
        self.handle.close()

    def close(self) -> None:
        self.handle.close()


def open_lines(path: str | Path) -> RecordLines:
    """The lines of the records file ``path``, which must be a regular file (a FIFO, a device
    such as ``/dev/zero``, a directory: :class:`TraceError` naming it and the rule, without
    reading it; :mod:`tokenfair.config.files`); ``OSError`` if it cannot be opened."""
    try:
        return RecordLines(open_regular(path))
    except InputFileError as exc:
        raise TraceError(str(exc)) from None


def too_long(line: bytes, where: str) -> TraceError | None:
    """The error of a line :class:`RecordLines` cut short (over :data:`MAX_LINE_BYTES`), or
    None. Checked only on lines the decoder refused: a cut line is no whole JSON value."""
    if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
        return TraceError(f"{where}: a line longer than {MAX_LINE_BYTES} bytes (1 MiB)")
    return None


def _rule(info: msgspec.inspect.Type, declared: object) -> str | None:
    """The rule a field's type states, as the error messages word it (None: not described).
    ``declared`` is the annotation itself: a ``Literal``'s values in the order written."""
    if isinstance(info, msgspec.inspect.UnionType):  # `X | None`: the rule is X's
        kinds = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        return _rule(kinds[0], declared) if len(kinds) == 1 else None
    if isinstance(info, msgspec.inspect.IntType) and info.ge == 0:
        return "an integer >= 0" + ("" if info.le is None else f" and <= {info.le}")
    if isinstance(info, msgspec.inspect.FloatType) and info.ge == 0:
        return "a number >= 0" + ("" if info.le is None else f" and <= {info.le:g}")
    if isinstance(info, msgspec.inspect.StrType) and info.min_length == 1:
        return "a non-empty string"
    if isinstance(info, msgspec.inspect.LiteralType):  # (its `values` are sorted)
        return f"one of {', '.join(map(str, get_args(declared) or info.values))}"
    return None


_SCHEMA: Final = msgspec.inspect.type_info(TraceLine)
assert isinstance(_SCHEMA, msgspec.inspect.StructType)
_FIELD_RULES: Final[dict[str, str | None]] = {
    field.name: _rule(field.type, declared.type)
    for field, declared in zip(_SCHEMA.fields, _TRACE_FIELDS, strict=True)
}
_AT_FIELD: Final = " - at `$."
NESTED_TOO_DEEPLY: Final = "JSON nested too deeply (a record is one flat JSON object)"


def _trace_error(line: bytes, where: str, exc: msgspec.MsgspecError) -> TraceError:
    """The decoder's refusal of ``line`` in the project's words: file:line, field(s), rule.

    Only the error path pays for this: the line is decoded again with ``json`` to name every
    unknown or missing key at once and to show the offending value.
    """
    cut = too_long(line, where)
    if cut is not None:
        return cut
    if not isinstance(exc, msgspec.ValidationError):  # (a ValidationError is a DecodeError)
        return TraceError(f"{where}: invalid JSON ({exc})")
    try:
        data = json.loads(line)
    except ValueError:  # the two JSON grammars differ at the edges (NaN, huge numbers)
        return TraceError(f"{where}: invalid JSON ({exc})")
    except RecursionError:  # `[[[…` 200,000 deep: msgspec refuses the array at once, json recurses
        return TraceError(f"{where}: {NESTED_TOO_DEEPLY}")
    if not isinstance(data, dict):
        return TraceError(f"{where}: a record must be a JSON object")
    unknown = sorted(set(data) - _TRACE_ACCEPTED)
    if unknown:
        return TraceError(f"{where}: unknown field(s) {', '.join(unknown)}")
    missing = [name for name in REQUIRED_FIELDS if name not in data]
    if missing:
        return TraceError(f"{where}: missing field(s) {', '.join(missing)}")
    message = str(exc)
    name = message.partition(_AT_FIELD)[2].rstrip("`")
    rule = _FIELD_RULES.get(name)
    if rule is None:  # a path the schema does not describe: msgspec's own words
        return TraceError(f"{where}: {message}")
    return TraceError(f"{where}: {name} must be {rule} (got {shown(data.get(name))})")


def decode_line(line: bytes, where: str) -> TraceLine:
    """Decode and validate one JSONL line; ``where`` (``file:line``) prefixes every error."""
    try:
        return _DECODER.decode(line)
    except msgspec.MsgspecError as exc:
        raise _trace_error(line, where, exc) from None


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """A request and what was observed when it ran (``None`` where unknown)."""

    request: Request
    actual_prefill_tokens: int | None = None
    actual_decode_tokens: int | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def from_line(cls, line: TraceLine) -> TraceRecord:
        """The record of a decoded line (its outcome fields, if any, are not kept)."""
        request = Request(
            line.request_id,
            line.tenant_id,
            line.arrival_ms,
            line.prefill_tokens,
            line.decode_tokens,
            line.priority_class,
        )
        return cls(
            request,
            line.actual_prefill_tokens,
            line.actual_decode_tokens,
            line.ttft_ms,
            line.e2e_ms,
        )

    def actual_tokens(self) -> tuple[int, int] | None:
        """Observed ``(prefill, decode)`` tokens (a side not recorded takes the request's), or
        None when the record carries neither."""
        if self.actual_prefill_tokens is None and self.actual_decode_tokens is None:
            return None
        prefill = self.request.prefill_tokens
        decode = self.request.decode_tokens
        if self.actual_prefill_tokens is not None:
            prefill = self.actual_prefill_tokens
        if self.actual_decode_tokens is not None:
            decode = self.actual_decode_tokens
        return prefill, decode

    def actual_service_tokens(self, decode_weight: float) -> int | None:
        """Observed usage in service tokens, or None when the record carries none."""
        tokens = self.actual_tokens()
        return None if tokens is None else service_tokens(*tokens, decode_weight)

    def to_line(self) -> TraceLine:
        """The record as a line of the schema (what :func:`dump_trace` writes)."""
        r = self.request
        return TraceLine(
            r.request_id, r.tenant_id, r.arrival_ms, r.prefill_tokens, r.decode_tokens,
            r.priority_class, self.actual_prefill_tokens, self.actual_decode_tokens,
            self.ttft_ms, self.e2e_ms,
        )  # fmt: skip

    def to_json(self) -> dict[str, object]:
        return line_fields(self.to_line())


def _int(where: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"{where}: {name} must be an integer >= 0 (got {value!r})")
    return value


def _flag(where: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TraceError(f"{where}: {name} must be true or false (got {value!r})")
    return value


def _ms(where: str, name: str, value: object, most: float = math.inf) -> float:
    """A number >= 0 and <= ``most``: a decision record's ``arrival_ms`` is bounded as in a
    request record (``MAX_RECORD_MS``); its other times may be infinite (``Infinity``)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= most:
        rule = "a number >= 0" + ("" if most == math.inf else f" and <= {most:g}")
        raise TraceError(f"{where}: {name} must be {rule} (got {value!r})")
    return float(value)


def _record_header(
    data: object, where: str, accepted: Collection[str], required: Sequence[str]
) -> tuple[dict[str, Any], PriorityClass]:
    """The checks of a decision record (``parse_decision``): a JSON object with only
    ``accepted`` keys, every ``required`` one, and a known ``priority_class``."""
    if not isinstance(data, dict):
        raise TraceError(f"{where}: a record must be a JSON object")
    unknown = sorted(set(data) - set(accepted))
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {', '.join(unknown)}")
    missing = [name for name in required if name not in data]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")
    priority = data["priority_class"]
    if priority not in PRIORITY_CLASSES:
        raise TraceError(
            f"{where}: priority_class must be one of {', '.join(PRIORITY_CLASSES)} "
            f"(got {priority!r})"
        )
    return data, priority


_TRACE_ACCEPTED: Final = frozenset(REQUIRED_FIELDS) | frozenset(OBSERVED_FIELDS) | OUTCOME_FIELDS


def iter_trace_lines(
    path: str | Path,
    known_tenants: Mapping[str, object] | Collection[str] | None = None,
    *,
    unique_ids: bool = True,
) -> Iterator[TraceLine]:
    """Stream a JSONL trace, one validated :class:`TraceLine` per non-blank line, in file order.

    With ``known_tenants``, every tenant must be one of them. With ``unique_ids`` (the default)
    a repeated ``request_id`` is an error; that check keeps every id seen so far (the one
    per-request cost of the stream: a caller that has checked the file once may turn it off).
    Errors name ``path:line``. Nothing else is kept: memory does not grow with the file.
    """
    seen: set[str] = set()
    for number, record in _decoded_lines(path, _DECODER):
        if unique_ids:
            if record.request_id in seen:
                raise _repeated_id(f"{path}:{number}", record.request_id)
            seen.add(record.request_id)
        if known_tenants is not None and record.tenant_id not in known_tenants:
            raise TraceError(
                f"{path}:{number}: tenant_id {record.tenant_id!r} is not in the tenants "
                f"file (known: {', '.join(known_tenants)})"
            )
        yield record


def _decoded_lines(path: str | Path, decoder: msgspec.json.Decoder[_T]) -> Iterator[tuple[int, _T]]:
    """``(line number, decoded line)`` for each non-blank line of ``path``, in file order; a
    line the decoder refuses raises :class:`TraceError` naming ``path:line``, field and rule."""
    decode = decoder.decode
    try:
        with open_lines(path) as lines:
            for number, line in enumerate(lines, start=1):
                try:
                    decoded = decode(line)
                except msgspec.MsgspecError as exc:
                    if not line.strip():
                        continue
                    raise _trace_error(line, f"{path}:{number}", exc) from None
                yield number, decoded
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror})") from None


def read_trace(
    path: str | Path, known_tenants: Mapping[str, object] | None = None
) -> list[TraceRecord]:
    """Read and validate a JSONL trace; with ``known_tenants``, every tenant must be known."""
    records = [TraceRecord.from_line(line) for line in iter_trace_lines(path, known_tenants)]
    if not records:
        raise TraceError(f"{path}: no records")
    return records


@dataclass(frozen=True, slots=True)
class TraceScan:
    """What one validating pass over a trace file learnt (:func:`scan_trace`)."""

    records: int
    in_order: bool
    """Every line comes after the one before it in ``(arrival_ms, request_id)`` order: the
    replay can stream the file as it is (otherwise it must hold and sort it)."""
    first_arrival_ms: float
    """The smallest ``arrival_ms``."""
    last_arrival_ms: float
    """The largest ``arrival_ms``."""
    observed_usage: bool
    """Some record carries ``actual_prefill_tokens`` or ``actual_decode_tokens``."""


def scan_trace(path: str | Path, known_tenants: Mapping[str, object] | None = None) -> TraceScan:
    """Validate a whole trace (every rule of :func:`iter_trace_lines`, an empty file is an
    error) and return its :class:`TraceScan`; keeps nothing of the records but their ids."""
    count = 0
    in_order = True
    observed_usage = False
    first_ms = last_ms = math.nan
    previous_ms, previous_id = -math.inf, ""
    for line in iter_trace_lines(path, known_tenants):
        count += 1
        arrival_ms = line.arrival_ms
        if count == 1:
            first_ms = arrival_ms
        # In order (the usual case) the first line has the smallest arrival and the last line
        # the largest: one comparison a line instead of a min and a max.
        if not in_order:
            first_ms = min(first_ms, arrival_ms)
            last_ms = max(last_ms, arrival_ms)
        elif arrival_ms > previous_ms or (
            arrival_ms == previous_ms and line.request_id > previous_id
        ):
            previous_ms, previous_id = arrival_ms, line.request_id
        else:
            in_order = False
            first_ms, last_ms = min(first_ms, arrival_ms), previous_ms
        if not observed_usage and (
            line.actual_prefill_tokens is not None or line.actual_decode_tokens is not None
        ):
            observed_usage = True
    if not count:
        raise TraceError(f"{path}: no records")
    if in_order:
        last_ms = previous_ms
    return TraceScan(count, in_order, first_ms, last_ms, observed_usage)


_REQUEST_DECODER: Final = msgspec.json.Decoder(Request)


def stream_requests(path: str | Path) -> Iterator[Request]:
    """The requests of a trace already validated (:func:`scan_trace`,
    :func:`stream_validated`), straight from the file.

    Decodes into ``Request`` in one step (types checked, the rules and the other fields
    skipped: ~0.3 µs a line): the replays after the first, which validated the file. A line
    that no longer decodes (the file changed since) raises ``TraceError`` naming it.
    """
    for _, request in _decoded_lines(path, _REQUEST_DECODER):
        yield request


def stream_arrivals(path: str | Path) -> Iterator[tuple[Request, None, None]]:
    """``(request, None, None)`` for each request of :func:`stream_requests`: the arrivals of
    a scanned trace without recorded usage, as the replay takes them (``simulator.Arrival``)."""
    for _, request in _decoded_lines(path, _REQUEST_DECODER):
        yield (request, None, None)


class TraceOutOfOrder(Exception):
    """Raised by :func:`stream_validated` at the first line that does not come after the one
    before it in ``(arrival_ms, request_id)`` order: the caller reads the file again and sorts
    it (a streamed replay needs the order)."""


Priced = Callable[[TraceLine], tuple[Request, int | None, int | None]]
"""How a line with recorded usage becomes an arrival: ``(request, actual service tokens,
actual KV blocks)`` (the command prices the usage with the policy's cost model)."""


def _repeated_id(where: str, request_id: str) -> TraceError:
    return TraceError(f"{where}: duplicate request_id {request_id!r}")


def _first_repeated_id(path: str | Path, last_line: float) -> None:
    """Raise the error :func:`iter_trace_lines` raises at the first repeated ``request_id`` of
    ``path`` up to line ``last_line`` (it reads the file again: a line before ``last_line``
    that breaks the schema raises its own error, as it does there); return if there is none."""
    seen: set[str] = set()
    for number, record in _decoded_lines(path, _DECODER):
        if number > last_line:
            return
        if record.request_id in seen:
            raise _repeated_id(f"{path}:{number}", record.request_id)
        seen.add(record.request_id)


class _StreamHooks:
    """The rules and words of :func:`stream_validated` that its compiled loop
    (:func:`reading.validated_arrivals`) hands back: every line the fast decoder refuses, and
    every error."""

    __slots__ = ("handle", "ids", "known_tenants", "path", "priced", "reading")

    def __init__(
        self,
        path: str | Path,
        known_tenants: Collection[str],
        reading: TraceReading,
        priced: Priced,
        ids: IdHashes,
    ) -> None:
        self.path = path
        self.known_tenants = known_tenants
        self.reading = reading
        self.priced = priced
        self.ids = ids
        self.handle: RecordLines | None = None

    def open_file(self) -> RecordLines:
        # Closed by the reader's `with`, or by `__del__` if the reader is dropped first.
        self.handle = open_lines(self.path)
        return self.handle

    def __del__(self) -> None:
        # The compiled reader runs no `finally` (nor `with` exit) when it is dropped before the
        # end of the file (an error in the replay) rather than closed (`close()`, which the
        # command calls): its hooks go with it and close the file when reference counting
        # frees them (freed by the cyclic collector, the file's own finalizer may come first
        # and warn, though the file is closed all the same).
        if self.handle is not None:
            self.handle.close()

    def hashes_repeated(self) -> bool:
        """Two ids read so far share a hash (:meth:`IdHashes.repeated`)."""
        return self.ids.repeated()

    def refuse(self, error: Exception, number: int) -> Exception:
        """``error`` (at line ``number``), unless an id repeats before it: then that error."""
        if self.hashes_repeated():
            _first_repeated_id(self.path, number)  # raises it, unless two ids only share a hash
        return error

    def other_line(self, line: bytes, number: int) -> tuple[Request, int | None, int | None] | None:
        if not line.strip():
            return None
        try:
            record = _DECODER.decode(line)
        except msgspec.MsgspecError as exc:
            raise self.refuse(_trace_error(line, f"{self.path}:{number}", exc), number) from None
        if record.actual_prefill_tokens is not None or record.actual_decode_tokens is not None:
            self.reading.observed_usage = True
            return self.priced(record)
        request = Request(
            record.request_id, record.tenant_id, record.arrival_ms,
            record.prefill_tokens, record.decode_tokens, record.priority_class,
        )  # fmt: skip
        return request, None, None

    def tenant_error(self, request: Request, number: int) -> Exception:
        return self.refuse(
            TraceError(
                f"{self.path}:{number}: tenant_id {request.tenant_id!r} is not in the "
                f"tenants file (known: {', '.join(self.known_tenants)})"
            ),
            number,
        )

    def order_error(self, request: Request, number: int) -> Exception:
        return self.refuse(TraceOutOfOrder(f"{self.path}:{number}: {request.request_id!r}"), number)

    def read_error(self, error: OSError) -> Exception:
        refusal = TraceError(f"{self.path}: cannot read ({error.strerror})")
        refusal.__suppress_context__ = True  # `raise ... from None` (compiled code drops it)
        return refusal

    def at_end(self, count: int) -> None:
        if self.hashes_repeated():
            _first_repeated_id(self.path, math.inf)
        if not count:
            raise TraceError(f"{self.path}: no records")


def stream_validated(
    path: str | Path,
    known_tenants: Mapping[str, object] | Collection[str],
    reading: TraceReading,
    priced: Priced,
) -> Iterator[tuple[Request, int | None, int | None]]:
    """Read a trace once, validating every line as it goes, and yield each as the replay's
    arrival: the one pass of a replay that needs no separate validating scan.

    Every rule of :func:`iter_trace_lines` (schema, unique ids, ``known_tenants``; an empty file
    is an error), with the same error for the same file: the first broken rule in file order,
    in the same words. The lines must also be in ``(arrival_ms, request_id)`` order: the first
    that is not raises :class:`TraceOutOfOrder` (the caller reads the file again, sorted).

    A line with the required keys only decodes straight into a :class:`TraceRequest` (a
    ``Request``), yielded as ``(request, None, None)``; one with observed or outcome keys is
    decoded by the full schema and yielded as ``priced(line)`` when it carries usage, else as
    ``(Request(...), None, None)`` (a plain request: the replay holds it while it is queued, not
    the line). ``reading`` is updated at each line and marked complete at the end.

    Unique ids are checked through their hashes (:class:`~tokenfair.records.reading.IdHashes`, 8
    bytes a line): at the end of the file, and before any other error is raised (so a repeated
    id earlier in the file is the error reported, as :func:`iter_trace_lines` would). A
    repeated id is therefore reported when the file has been read, not at its line: a consumer
    that must not act on a trace with a bad line (write records, print a report) waits for the
    end.

    The per-line loop is :func:`tokenfair.records.reading.validated_arrivals` (compiled with the
    core, docs/native.md); the rules and words it hands back are here (``_StreamHooks``).
    Nothing is read before the first arrival is asked for.
    """
    ids = IdHashes()
    hooks = _StreamHooks(path, known_tenants, reading, priced, ids)
    decode = _REQUEST_LINE_DECODER.decode
    return validated_arrivals(decode, known_tenants, reading, ids, hooks)


# ---------------------------------------------------------------------------------------------
# Writing records: one schema for each kind of line, one encoding rule, one encoder.
#
# A line is a msgspec struct: :class:`TraceLine` (a request record: ``tokenfair trace generate``)
# or :class:`RecordLine` (a decision record: ``tokenfair simulate --records``, the sidecar's
# records file, ``tokenfair loadgen --records``), optionally preceded by ``policy``. Its fields,
# in declaration order, are the keys of the line; a field whose default is None is left out when
# None, the others are always written (None as ``null``). The encoding rule is Python's
# ``json.dumps(..., separators=(",", ":"))``: compact, ASCII only (``\uXXXX`` escapes), numbers
# as ``repr`` writes them, non-finite ones as ``Infinity``/``NaN``. :func:`plain_line` applies it
# (the reference); :func:`encode_record_line` and :func:`encode_trace_line` are the fast path
# (msgspec) and fall back to it for what msgspec writes otherwise, so both give the same bytes.


RECORD_FIELDS: Final = msgspec.structs.fields(RecordLine)
DECISION_FIELDS: Final = tuple(f.name for f in dataclasses.fields(Decision))
"""``Decision``'s fields in declaration order (the order of a decision record's keys)."""
if tuple(f.name for f in RECORD_FIELDS[: len(DECISION_FIELDS)]) != DECISION_FIELDS:
    raise AssertionError("RecordLine must begin with Decision's fields, in Decision's order")

# The encoding rule. msgspec writes the same bytes as `json.dumps` for every value but three:
# a float outside [1e-4, 1e16) other than zero (msgspec `1e-7`, `0.00001`, `1e16`; json `1e-07`,
# `1e-05`, `1e+16`; inf and nan included: msgspec writes `null`), a non-ASCII character and DEL
# (json escapes them, msgspec writes them as UTF-8). A line holding any of them takes the plain
# path. The bounds are checked on the values, the characters on the output.
_ENCODE: Final = msgspec.json.Encoder().encode
_LO: Final = 1e-4
_HI: Final = 1e16


def _float_fields(cls: type[msgspec.Struct]) -> Callable[[Any], tuple[Any, ...]]:
    """A getter of the fields of ``cls`` typed ``float`` (or ``float | None``), as a tuple: the
    numbers the fast path must check (an ``int`` is written alike by both encoders)."""
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    names = []
    for field in info.fields:
        kinds = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else ()
        if isinstance(field.type, msgspec.inspect.FloatType) or any(
            isinstance(kind, msgspec.inspect.FloatType) for kind in kinds
        ):
            names.append(field.name)
    assert len(names) > 1  # (one name would make the getter return the value, not a tuple)
    return operator.attrgetter(*names)


_RECORD_FLOATS: Final = _float_fields(RecordLine)
_TRACE_FLOATS: Final = _float_fields(TraceLine)
_OPTIONAL: Final = {
    cls: tuple(
        (f.name, f.default is None or f.default is False, f.default)
        for f in msgspec.structs.fields(cls)
    )
    for cls in (RecordLine, TraceLine)
}


def line_fields(line: RecordLine | TraceLine, policy: str | None = None) -> dict[str, object]:
    """The JSON object a line stands for: ``policy`` first (when given), then the fields in
    the schema's order, those defaulting to None (or ``would_refuse``'s False) only when set."""
    out: dict[str, object] = {} if policy is None else {"policy": policy}
    for name, optional, default in _OPTIONAL[type(line)]:
        value = getattr(line, name)
        if not optional or value is not default:
            out[name] = value
    return out


def dumps_fields(fields: Mapping[str, object]) -> bytes:
    """The encoding rule, applied plainly: ``json.dumps`` compact, ASCII only (no newline)."""
    return json.dumps(fields, separators=(",", ":")).encode()


def plain_line(line: RecordLine | TraceLine, policy: str | None = None) -> bytes:
    """The reference encoder: ``dumps_fields(line_fields(line, policy))`` (no newline)."""
    return dumps_fields(line_fields(line, policy))


def _exact(numbers: Iterable[float | None]) -> bool:
    """msgspec writes each of ``numbers`` as ``json`` does: None, zero, or 1e-4 <= |x| < 1e16
    (so finite; a nan fails every comparison)."""
    for x in numbers:  # noqa: SIM110 (all() over a generator is slower: this runs per record)
        if not (x is None or _LO <= x < _HI or x == 0 or -_HI < x <= -_LO):
            return False
    return True


_PREFIXES: Final[dict[str, bytes]] = {}
"""``{"policy":"<policy>",`` by policy name (a handful of names; at most 64 kept)."""


def _fast(line: RecordLine | TraceLine, policy: str | None) -> bytes | None:
    """msgspec's encoding of ``line`` (``policy`` first), or None if it holds a character
    ``json`` escapes and msgspec does not (non-ASCII, DEL). Its numbers are checked already."""
    body = _ENCODE(line)
    if policy is not None:
        prefix = _PREFIXES.get(policy)
        if prefix is None:
            prefix = b'{"policy":' + _ENCODE(policy) + b","
            if len(_PREFIXES) < 64:
                _PREFIXES[policy] = prefix
        body = prefix + body[1:]
    return body if body.isascii() and b"\x7f" not in body else None


def encode_record_line(line: RecordLine, policy: str | None = None) -> bytes:
    """The JSON text of a decision record (no newline): :func:`plain_line`'s bytes, fast."""
    try:
        observed = line.observed
        if _exact(_RECORD_FLOATS(line)) and (not observed or _exact(observed.values())):
            body = _fast(line, policy)
            if body is not None:
                return body
    except (msgspec.MsgspecError, TypeError, ValueError):  # (a lone surrogate, a bad type)
        pass
    return plain_line(line, policy)


def encode_trace_line(line: TraceLine) -> bytes:
    """The JSON text of a request record (no newline): :func:`plain_line`'s bytes, fast."""
    try:
        if _exact(_TRACE_FLOATS(line)):
            body = _fast(line, None)
            if body is not None:
                return body
    except (msgspec.MsgspecError, TypeError, ValueError):
        pass
    return plain_line(line)


def decision_line(
    decision: Decision,
    status_code: int | None = None,
    reason: str | None = None,
    ttft_ms: float | None = None,
    prefill_tokens: int | None = None,
    decode_tokens: int | None = None,
    actual_prefill_tokens: int | None = None,
    actual_decode_tokens: int | None = None,
    e2e_ms: float | None = None,
) -> RecordLine:
    """The record line of a ``Decision``: its fields, with the outcome the client saw when one
    is given (``status_code``, ``reason``, ``ttft_ms``: the sidecar's), then the request fields
    a live record adds (the sidecar's and loadgen's; None: left out). The one place a
    ``RecordLine`` is built (positionally, in the schema's order: keywords cost ~1 µs a line;
    the tests check it against the dict built key by key)."""
    d = decision
    return RecordLine(
        d.request_id, d.tenant_id, d.priority_class,
        d.status_code if status_code is None else status_code,
        d.reason if reason is None else reason,
        d.gate, d.service_tokens, d.arrival_ms, d.kv_occupancy_ratio, d.queue_wait_ms,
        d.ttft_ms if ttft_ms is None else ttft_ms,
        d.dispatch_ms, d.retry_after_ms, d.actual_service_tokens, d.observed, d.would_refuse,
        prefill_tokens, decode_tokens, actual_prefill_tokens, actual_decode_tokens, e2e_ms,
    )  # fmt: skip


def decision_to_json(decision: Decision, policy: str | None = None) -> dict[str, object]:
    """A decision record: ``policy`` (when given), then ``Decision``'s fields in its order.

    The same dict ``dataclasses.asdict`` gives (``observed`` copied; ``would_refuse`` only when
    it is true, as a record line holds it), built field by field:
    ``asdict`` deep-copies every value and was a large share of the sidecar's per-request CPU.
    """
    out: dict[str, object] = {} if policy is None else {"policy": policy}
    for name in DECISION_FIELDS:
        out[name] = getattr(decision, name)
    out["observed"] = dict(decision.observed)
    if not decision.would_refuse:  # written only when set (shadow mode), as in a record
        del out["would_refuse"]
    return out


def encode_decision(decision: Decision, policy: str | None = None) -> bytes:
    """The JSONL line (newline included) of :func:`decision_to_json`'s record: the record line
    of the ``Decision`` (:func:`decision_line`) by :func:`encode_record_line`."""
    return encode_record_line(decision_line(decision), policy) + b"\n"


def write_decisions(path: str | Path, results: Mapping[str, Iterable[Decision]]) -> None:
    with Path(path).open("wb") as handle:
        for policy, decisions in results.items():
            handle.writelines(encode_decision(decision, policy) for decision in decisions)


def dump_decisions(handle: TextIO, results: Mapping[str, Iterable[Decision]]) -> None:
    for policy, decisions in results.items():
        for decision in decisions:
            handle.write(encode_decision(decision, policy).decode())


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> None:
    with Path(path).open("w", encoding="utf-8") as handle:
        dump_trace(handle, records)


def dump_trace(handle: TextIO, records: Iterable[TraceRecord]) -> None:
    """Write request records as JSONL to an open stream (:func:`encode_trace_line`)."""
    for record in records:
        handle.write(encode_trace_line(record.to_line()).decode() + "\n")


# ---------------------------------------------------------------------------------------------
# Reading decision records back (``tokenfair report``): the inverse of ``decision_to_json``.

DECISION_REQUIRED_FIELDS: Final = tuple(
    f.name
    for f in dataclasses.fields(Decision)
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
)
"""The fields a decision record must have: those of ``Decision`` without a default."""
_DECISION_ACCEPTED: Final = (
    frozenset(DECISION_FIELDS)
    | {"policy", "estimated_service_tokens"}
    | set(REQUIRED_FIELDS)
    | set(OBSERVED_FIELDS)
)
_T = TypeVar("_T")
_D = TypeVar("_D")
UNNAMED_POLICY: Final = "unnamed"
"""The group of decision records that carry no ``policy``."""


def _text(where: str, name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise TraceError(f"{where}: {name} must be a non-empty string (got {value!r})")
    return value


def _optional(
    where: str,
    data: Mapping[str, object],
    name: str,
    parse: Callable[[str, str, object], _T],
    default: _D,
) -> _T | _D:
    """``parse(where, name, value)`` of an optional field; ``default`` when absent or null."""
    value = data.get(name)
    return default if value is None else parse(where, name, value)


def _observed(where: str, name: str, value: object) -> dict[str, float]:
    if not isinstance(value, dict):
        raise TraceError(f"{where}: {name} must be an object of numbers (got {value!r})")
    for key, number in value.items():
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise TraceError(f"{where}: {name}.{key} must be a number (got {number!r})")
    return {key: float(number) for key, number in value.items()}


def parse_decision(data: object, where: str) -> tuple[str, Decision]:
    """Validate one decoded decision record; returns ``(policy, decision)``.

    Accepts what :func:`decision_to_json` writes and what the sidecar and loadgen write (a
    decision record plus the request fields; those are checked and dropped). Required: the
    fields of :data:`DECISION_REQUIRED_FIELDS`; ``policy`` defaults to :data:`UNNAMED_POLICY`.
    """
    data, priority_class = _record_header(data, where, _DECISION_ACCEPTED, DECISION_REQUIRED_FIELDS)
    # The request fields a live record carries: validated so a corrupt line is named, not used.
    for name in ("prefill_tokens", "decode_tokens", "estimated_service_tokens"):
        _optional(where, data, name, _int, None)
    for name in ("actual_prefill_tokens", "actual_decode_tokens"):
        _optional(where, data, name, _int, None)
    _optional(where, data, "e2e_ms", _ms, None)
    decision = Decision(
        request_id=_text(where, "request_id", data["request_id"]),
        tenant_id=_text(where, "tenant_id", data["tenant_id"]),
        priority_class=priority_class,
        status_code=_int(where, "status_code", data["status_code"]),
        reason=_text(where, "reason", data["reason"]),
        gate=_text(where, "gate", data["gate"]),
        service_tokens=_int(where, "service_tokens", data["service_tokens"]),
        arrival_ms=_ms(where, "arrival_ms", data["arrival_ms"], MAX_RECORD_MS),
        kv_occupancy_ratio=_optional(where, data, "kv_occupancy_ratio", _ms, 0.0),
        queue_wait_ms=_optional(where, data, "queue_wait_ms", _ms, 0.0),
        ttft_ms=_optional(where, data, "ttft_ms", _ms, 0.0),
        dispatch_ms=_optional(where, data, "dispatch_ms", _ms, None),
        retry_after_ms=_optional(where, data, "retry_after_ms", _ms, None),
        actual_service_tokens=_optional(where, data, "actual_service_tokens", _int, None),
        observed=_optional(where, data, "observed", _observed, dict[str, float]()),
        would_refuse=_optional(where, data, "would_refuse", _flag, False),
    )
    policy = _optional(where, data, "policy", _text, UNNAMED_POLICY)
    return policy, decision


def read_decisions(path: str | Path) -> dict[str, list[Decision]]:
    """Read decision records (JSONL) grouped by ``policy``, in file order within each group.

    A ``request_id`` may appear once per policy; an empty file is an error.
    """
    results: dict[str, list[Decision]] = {}
    seen: dict[str, set[str]] = {}
    try:
        with open_lines(path) as lines:
            for number, raw in enumerate(lines, start=1):
                where = f"{path}:{number}"
                cut = too_long(raw, where)
                if cut is not None:
                    raise cut
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{where}: invalid JSON ({exc.msg})") from None
                except RecursionError:
                    raise TraceError(f"{where}: {NESTED_TOO_DEEPLY}") from None
                policy, decision = parse_decision(data, where)
                ids = seen.setdefault(policy, set())
                if decision.request_id in ids:
                    raise TraceError(
                        f"{where}: duplicate request_id {decision.request_id!r} (policy {policy!r})"
                    )
                ids.add(decision.request_id)
                results.setdefault(policy, []).append(decision)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason})") from None
    if not results:
        raise TraceError(f"{path}: no records")
    return results
