"""Request records (JSONL): the trace format the simulator replays and the sidecar writes.

One JSON object per line. Required: ``request_id`` (str), ``tenant_id`` (str), ``arrival_ms``
(number >= 0), ``prefill_tokens`` and ``decode_tokens`` (int >= 0), ``priority_class``
(``interactive|batch``). Optional observed fields: ``actual_prefill_tokens``,
``actual_decode_tokens`` (what the backend reported), ``ttft_ms`` and ``e2e_ms`` (observed times).
Outcome fields of a decision record (``status_code``, ``reason``, ``queue_wait_ms``, …, see
:data:`OUTCOME_FIELDS`) may be present and are ignored on replay, so a sidecar's records replay
as they are. Any other key is an error naming the line. Schema: docs/records.md.

Decision records are written by :func:`decision_to_json` (``tokenfair simulate --records``, the
sidecar, loadgen) and read back into ``Decision`` objects by :func:`read_decisions`
(``tokenfair report``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TextIO, TypeVar

from tokenfair_sidecar.config import PRIORITY_CLASSES, PriorityClass
from tokenfair_sidecar.core import Decision, Request
from tokenfair_sidecar.costmodel import service_tokens

REQUIRED_FIELDS: Final = (
    "request_id",
    "tenant_id",
    "arrival_ms",
    "prefill_tokens",
    "decode_tokens",
    "priority_class",
)
OBSERVED_FIELDS: Final = ("actual_prefill_tokens", "actual_decode_tokens", "ttft_ms", "e2e_ms")
OUTCOME_FIELDS: Final = frozenset(f.name for f in dataclasses.fields(Decision)) | {
    "policy",
    "estimated_service_tokens",
}


class TraceError(ValueError):
    """A trace line broke the schema; the message names the file, line and field."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """A request and what was observed when it ran (``None`` where unknown)."""

    request: Request
    actual_prefill_tokens: int | None = None
    actual_decode_tokens: int | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None

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

    def to_json(self) -> dict[str, object]:
        request = self.request
        out: dict[str, object] = {
            "request_id": request.request_id,
            "tenant_id": request.tenant_id,
            "arrival_ms": request.arrival_ms,
            "prefill_tokens": request.prefill_tokens,
            "decode_tokens": request.decode_tokens,
            "priority_class": request.priority_class,
        }
        for name in OBSERVED_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out


def _int(where: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceError(f"{where}: {name} must be an integer >= 0 (got {value!r})")
    return value


def _ms(where: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise TraceError(f"{where}: {name} must be a number >= 0 (got {value!r})")
    return float(value)


def _record_header(
    data: object, where: str, accepted: Collection[str], required: Sequence[str]
) -> tuple[dict[str, Any], PriorityClass]:
    """The checks every record kind shares: a JSON object with only ``accepted`` keys, every
    ``required`` one, and a known ``priority_class``."""
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


def parse_record(data: object, where: str) -> TraceRecord:
    """Validate one decoded JSON object; ``where`` prefixes every error."""
    data, priority_class = _record_header(data, where, _TRACE_ACCEPTED, REQUIRED_FIELDS)
    for name in ("request_id", "tenant_id"):
        if not isinstance(data[name], str) or not data[name]:
            raise TraceError(f"{where}: {name} must be a non-empty string")
    request = Request(
        request_id=data["request_id"],
        tenant_id=data["tenant_id"],
        arrival_ms=_ms(where, "arrival_ms", data["arrival_ms"]),
        prefill_tokens=_int(where, "prefill_tokens", data["prefill_tokens"]),
        decode_tokens=_int(where, "decode_tokens", data["decode_tokens"]),
        priority_class=priority_class,
    )
    observed: dict[str, Any] = {}
    for name in ("actual_prefill_tokens", "actual_decode_tokens"):
        if data.get(name) is not None:
            observed[name] = _int(where, name, data[name])
    for name in ("ttft_ms", "e2e_ms"):
        if data.get(name) is not None:
            observed[name] = _ms(where, name, data[name])
    return TraceRecord(request, **observed)


def _parse_line(line: str, where: str) -> TraceRecord:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: invalid JSON ({exc.msg})") from None
    return parse_record(data, where)


def read_trace(
    path: str | Path, known_tenants: Mapping[str, object] | None = None
) -> list[TraceRecord]:
    """Read and validate a JSONL trace; with ``known_tenants``, every tenant must be known."""
    records: list[TraceRecord] = []
    seen: set[str] = set()
    try:
        with Path(path).open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                record = _parse_line(line, f"{path}:{number}")
                request = record.request
                if request.request_id in seen:
                    raise TraceError(
                        f"{path}:{number}: duplicate request_id {request.request_id!r}"
                    )
                seen.add(request.request_id)
                if known_tenants is not None and request.tenant_id not in known_tenants:
                    raise TraceError(
                        f"{path}:{number}: tenant_id {request.tenant_id!r} is not in the tenants "
                        f"file (known: {', '.join(known_tenants)})"
                    )
                records.append(record)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror})") from None
    if not records:
        raise TraceError(f"{path}: no records")
    return records


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> None:
    with Path(path).open("w", encoding="utf-8") as handle:
        dump_trace(handle, records)


def dump_trace(handle: TextIO, records: Iterable[TraceRecord]) -> None:
    """Write request records as JSONL to an open stream."""
    for record in records:
        handle.write(json.dumps(record.to_json(), separators=(",", ":")) + "\n")


DECISION_FIELDS: Final = tuple(f.name for f in dataclasses.fields(Decision))
"""``Decision``'s fields in declaration order (the order of a decision record's keys)."""


def decision_to_json(decision: Decision, policy: str | None = None) -> dict[str, object]:
    """A decision record: ``policy`` (when given), then the lesson's outcome fields, then ours.

    The same dict ``dataclasses.asdict`` gives (``observed`` copied), built field by field:
    ``asdict`` deep-copies every value and was a large share of the sidecar's per-request CPU.
    """
    out: dict[str, object] = {} if policy is None else {"policy": policy}
    for name in DECISION_FIELDS:
        out[name] = getattr(decision, name)
    out["observed"] = dict(decision.observed)
    return out


def write_decisions(path: str | Path, results: Mapping[str, Iterable[Decision]]) -> None:
    with Path(path).open("w", encoding="utf-8") as handle:
        dump_decisions(handle, results)


def dump_decisions(handle: TextIO, results: Mapping[str, Iterable[Decision]]) -> None:
    for policy, decisions in results.items():
        for decision in decisions:
            handle.write(json.dumps(decision_to_json(decision, policy), separators=(",", ":")))
            handle.write("\n")


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
        arrival_ms=_ms(where, "arrival_ms", data["arrival_ms"]),
        kv_occupancy_ratio=_optional(where, data, "kv_occupancy_ratio", _ms, 0.0),
        queue_wait_ms=_optional(where, data, "queue_wait_ms", _ms, 0.0),
        ttft_ms=_optional(where, data, "ttft_ms", _ms, 0.0),
        dispatch_ms=_optional(where, data, "dispatch_ms", _ms, None),
        retry_after_ms=_optional(where, data, "retry_after_ms", _ms, None),
        actual_service_tokens=_optional(where, data, "actual_service_tokens", _int, None),
        observed=_optional(where, data, "observed", _observed, dict[str, float]()),
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
        with Path(path).open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    data = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"{where}: invalid JSON ({exc.msg})") from None
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
