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
from pathlib import Path
from typing import Any, Final

from tokenfair_sidecar.core import Decision, Request
from tokenfair_sidecar.records import decision_to_json

_ENCODER: Final = json.JSONEncoder(separators=(",", ":"))


def request_record(
    request: Request,
    decision: Decision,
    policy: str,
    *,
    status_code: int,
    reason: str,
    actual_prefill_tokens: int | None = None,
    actual_decode_tokens: int | None = None,
    ttft_ms: float | None = None,
    e2e_ms: float | None = None,
) -> dict[str, Any]:
    record: dict[str, Any] = decision_to_json(decision, policy)
    record["prefill_tokens"] = request.prefill_tokens
    record["decode_tokens"] = request.decode_tokens
    record["status_code"] = status_code
    record["reason"] = reason
    if actual_prefill_tokens is not None:
        record["actual_prefill_tokens"] = actual_prefill_tokens
    if actual_decode_tokens is not None:
        record["actual_decode_tokens"] = actual_decode_tokens
    if ttft_ms is not None:
        record["ttft_ms"] = round(ttft_ms, 2)
    if e2e_ms is not None:
        record["e2e_ms"] = round(e2e_ms, 2)
    return record


class RecordWriter:
    """Appends records to a JSONL file (opened and closed by the app's cleanup context).

    ``write`` encodes at once and queues the line; one flush per event-loop iteration writes
    the queued lines together (outside a running loop, at once).
    """

    def __init__(self, path: str | Path) -> None:
        # Held open for the app's lifetime; the cleanup context closes it.
        self._handle = Path(path).open("ab")  # noqa: SIM115
        self._pending: list[str] = []

    def write(self, record: dict[str, Any]) -> None:
        pending = self._pending
        pending.append(_ENCODER.encode(record))
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
