"""The sidecar's request record: a :class:`~tokenfair.records.schema.RecordLine` built from a
request, the core's decision, the outcome the client saw and the usage the backend reported.

The encoding half of the sidecar's records file (``server/record_writer.py`` writes the lines,
buffered): ``policy``, the decision's fields, the trace fields ``prefill_tokens`` /
``decode_tokens`` (the estimate), ``actual_prefill_tokens`` / ``actual_decode_tokens`` (the
usage the backend reported), ``ttft_ms`` and ``e2e_ms``; ``status_code`` and ``reason`` are the
outcome the client saw (e.g. ``502 upstream_error``, ``499 cancelled``, ``503 draining``). Every
line goes through the records' one encoder (:mod:`tokenfair.records.codec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from tokenfair.core import Decision, Request
from tokenfair.records.codec import (
    RecordLine,
    decision_line,
    dumps_fields,
    encode_record_line,
    line_fields,
)


@dataclass(frozen=True, slots=True)
class Usage:
    """What a finished request reported (None: unknown) and when its bytes went out."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None


NO_USAGE: Final = Usage()


def record_line(
    request: Request, decision: Decision, *, status_code: int, reason: str, usage: Usage = NO_USAGE
) -> RecordLine:
    """The request's record line (:class:`~tokenfair.records.codec.RecordLine`): the decision with
    the outcome the client saw (``status_code``, ``reason``), the measured ``ttft_ms`` when there
    is one, the estimate and the reported usage. Times measured here are rounded to 0.01 ms."""
    ttft_ms, e2e_ms = usage.ttft_ms, usage.e2e_ms
    return decision_line(
        decision, status_code, reason, None if ttft_ms is None else round(ttft_ms, 2),
        request.prefill_tokens, request.decode_tokens, usage.prompt_tokens,
        usage.completion_tokens, None if e2e_ms is None else round(e2e_ms, 2),
    )  # fmt: skip


def request_record(
    request: Request,
    decision: Decision,
    policy: str,
    *,
    status_code: int,
    reason: str,
    usage: Usage = NO_USAGE,
) -> dict[str, Any]:
    """The record as a dict (the shape; :func:`encode_record` writes the same as JSON text)."""
    line = record_line(request, decision, status_code=status_code, reason=reason, usage=usage)
    return line_fields(line, policy)


def encode_record(
    request: Request,
    decision: Decision,
    policy: str,
    *,
    status_code: int,
    reason: str,
    usage: Usage = NO_USAGE,
) -> str:
    """The record's JSON text (one line, no newline): :func:`request_record` by the records'
    one encoder (:func:`tokenfair.records.codec.encode_record_line`), which writes what ``json``
    writes, byte for byte."""
    line = record_line(request, decision, status_code=status_code, reason=reason, usage=usage)
    return encode_record_line(line, policy).decode()


def minimal_record(request: Request, policy: str, *, status_code: int, reason: str) -> str:
    """A record of the request's own fields and its outcome only (JSON text): written when the
    full record cannot be encoded (a bug), so that the request still has its one record. It
    holds the trace fields a replay needs; the decision's fields are missing. Encoded plainly
    (:func:`tokenfair.records.codec.dumps_fields`), in the schema's key order."""
    return dumps_fields(
        {
            "policy": policy,
            "request_id": request.request_id,
            "tenant_id": request.tenant_id,
            "priority_class": request.priority_class,
            "status_code": status_code,
            "reason": reason,
            "arrival_ms": request.arrival_ms,
            "prefill_tokens": request.prefill_tokens,
            "decode_tokens": request.decode_tokens,
        }
    ).decode()
