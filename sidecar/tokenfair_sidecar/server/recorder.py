"""Request records: one JSONL line per request that reached admission.

A record is the core's decision record (the shape of
:func:`tokenfair_sidecar.records.decision_to_json`, with ``policy``) plus the trace fields
``prefill_tokens`` / ``decode_tokens`` (the estimate), ``actual_prefill_tokens`` /
``actual_decode_tokens`` (the usage the backend reported), ``ttft_ms`` and ``e2e_ms``;
``status_code`` and ``reason`` are the outcome the client saw (e.g. ``502 upstream_error``,
``499 cancelled``, ``503 draining``). So ``tokenfair simulate --trace FILE`` replays the recorded
traffic as it is. Times are model milliseconds since the sidecar started.

Writes are buffered and flushed once per event-loop iteration (``loop.call_soon``), so one
``write(2)`` covers every request finished in that iteration rather than one per line; a crash
loses at most the records of the iteration it happened in. ``close`` flushes what is left.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from tokenfair_sidecar.core import Decision, Request
from tokenfair_sidecar.records import decision_to_json

_ENCODER: Final = json.JSONEncoder(separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Usage:
    """What a finished request reported (None: unknown) and when its bytes went out."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None


NO_USAGE: Final = Usage()


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
    record: dict[str, Any] = decision_to_json(decision, policy)
    record["prefill_tokens"] = request.prefill_tokens
    record["decode_tokens"] = request.decode_tokens
    record["status_code"] = status_code
    record["reason"] = reason
    if usage.prompt_tokens is not None:
        record["actual_prefill_tokens"] = usage.prompt_tokens
    if usage.completion_tokens is not None:
        record["actual_decode_tokens"] = usage.completion_tokens
    if usage.ttft_ms is not None:
        record["ttft_ms"] = round(usage.ttft_ms, 2)
    if usage.e2e_ms is not None:
        record["e2e_ms"] = round(usage.e2e_ms, 2)
    return record


_string: Final = json.encoder.encode_basestring_ascii
"""json's own string encoder (C): the quoted, escaped, ASCII-only JSON string."""


def encode_record(
    request: Request,
    decision: Decision,
    policy: str,
    *,
    status_code: int,
    reason: str,
    usage: Usage = NO_USAGE,
) -> str:
    """``_ENCODER.encode(request_record(...))``, the same text byte for byte, written directly.

    ``json``'s C encoder calls back into a Python function for every float (six per record):
    the dict-then-encode path costs ~7 µs per record, this ~3.5 (tight loop). Numbers are
    written with ``repr``, which is what ``json`` writes for finite floats and for ints (never
    bools here: the estimate and usage parsers refuse them). A record with a non-finite number
    (``json`` writes ``Infinity``/``NaN``) takes the slow path, so the output always equals
    ``json``'s; ``observed`` (refusals only) is encoded by ``json``.
    """
    d = decision
    ttft_ms, e2e_ms = usage.ttft_ms, usage.e2e_ms
    ttft = d.ttft_ms if ttft_ms is None else round(ttft_ms, 2)
    dispatch, retry, actual = d.dispatch_ms, d.retry_after_ms, d.actual_service_tokens
    text = (
        f'{{"policy":{_string(policy)},"request_id":{_string(d.request_id)},'
        f'"tenant_id":{_string(d.tenant_id)},"priority_class":{_string(d.priority_class)},'
        f'"status_code":{status_code!r},"reason":{_string(reason)},"gate":{_string(d.gate)},'
        f'"service_tokens":{d.service_tokens!r},"arrival_ms":{d.arrival_ms!r},'
        f'"kv_occupancy_ratio":{d.kv_occupancy_ratio!r},"queue_wait_ms":{d.queue_wait_ms!r},'
        f'"ttft_ms":{ttft!r},"dispatch_ms":{"null" if dispatch is None else repr(dispatch)},'
        f'"retry_after_ms":{"null" if retry is None else repr(retry)},'
        f'"actual_service_tokens":{"null" if actual is None else repr(actual)},'
        f'"observed":{_ENCODER.encode(d.observed) if d.observed else "{}"},'
        f'"prefill_tokens":{request.prefill_tokens!r},"decode_tokens":{request.decode_tokens!r}'
    )
    if usage.prompt_tokens is not None:
        text += f',"actual_prefill_tokens":{usage.prompt_tokens!r}'
    if usage.completion_tokens is not None:
        text += f',"actual_decode_tokens":{usage.completion_tokens!r}'
    if e2e_ms is not None:
        text += f',"e2e_ms":{round(e2e_ms, 2)!r}'
    text += "}"
    finite = d.arrival_ms + d.kv_occupancy_ratio + d.queue_wait_ms + ttft + (dispatch or 0.0)
    finite += (retry or 0.0) + (e2e_ms or 0.0)
    if finite - finite != 0.0:  # an inf or a nan among them (or a sum that overflowed)
        return _ENCODER.encode(
            request_record(request, d, policy, status_code=status_code, reason=reason, usage=usage)
        )
    return text


class RecordWriter:
    """Appends records to a JSONL file (opened and closed by the app's cleanup context).

    ``write`` queues an encoded line (:func:`encode_record`); one flush per event-loop
    iteration writes the queued lines together (outside a running loop, at once).
    """

    def __init__(self, path: str | Path) -> None:
        # Held open for the app's lifetime; the cleanup context closes it.
        self._handle = Path(path).open("ab")  # noqa: SIM115
        self._pending: list[str] = []

    def write(self, line: str) -> None:
        """Queue one record's JSON text (one line, without the newline)."""
        pending = self._pending
        pending.append(line)
        if len(pending) == 1:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop running: write through
                self.flush()

    def flush(self) -> None:
        if self._pending and not self._handle.closed:
            self._pending.append("")  # the last line's newline
            self._handle.write("\n".join(self._pending).encode("utf-8"))
            self._handle.flush()
        self._pending.clear()

    def close(self) -> None:
        self.flush()
        self._handle.close()
