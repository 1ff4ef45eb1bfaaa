"""The request-record schema (``records.TraceLine``) and its compiled decoder, and the streaming
reads and writes built on it.

Behaviours under test:

* every rule of the schema refused with ``file:line``, the field and the rule in the project's
  words (not the decoder's), whichever field breaks it: empty or non-string ids, negative,
  boolean or non-numeric times and sizes, non-integer sizes, an unknown priority class;
  every unknown key and every missing key named at once; a line that is not an object; a line
  that is not JSON (``NaN`` included); a duplicate id; an unknown tenant; an empty file;
* what is accepted: blank lines (skipped, still counted), ``null`` observed fields (same as
  absent), the outcome fields of a sidecar's decision record (skipped, whatever their type);
* the schema is the one the docs state: ``docs/records.md``'s request table lists exactly the
  schema's fields, required ones as required;
* ``scan_trace``: the count, whether the lines are in ``(arrival_ms, request_id)`` order, the
  first and last arrival whatever the order, whether any record carries usage;
* ``scan_trace`` refuses what ``read_trace`` refuses, in the same words, naming the same
  line;
* ``stream_requests`` yields the requests ``read_trace`` reads, in file order, and
  ``stream_arrivals`` the same as the replay's arrivals;
* ``encode_decision`` writes what ``decision_to_json`` describes (same keys, order and values),
  also for non-finite numbers (written by ``json``, read back as they were);
* ``simulator.replay`` streams: it refuses arrivals out of order, and the decisions and requests
  it holds stay bounded by the backlog, not the length of the trace.
"""

from __future__ import annotations

import gc
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from repo_paths import REPO_ROOT

from tokenfair.config import Config, PolicyConfig, TenantConfig, build_config
from tokenfair.core import Decision, Request
from tokenfair.records.codec import (
    OBSERVED_FIELDS,
    REQUIRED_FIELDS,
    TraceError,
    decision_to_json,
    encode_decision,
    read_trace,
    scan_trace,
    stream_arrivals,
    stream_requests,
)
from tokenfair.sim.simulator import Arrival, replay

DOCS = REPO_ROOT / "docs" / "records.md"
GOOD: dict[str, object] = {
    "request_id": "r1",
    "tenant_id": "t",
    "arrival_ms": 5,
    "prefill_tokens": 100,
    "decode_tokens": 10,
    "priority_class": "batch",
}


def trace_file(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def line(**changes: object) -> str:
    return json.dumps({**GOOD, "request_id": "r2", **changes})


def refusal(path: Path, known: dict[str, object] | None = None) -> str:
    with pytest.raises(TraceError) as caught:
        read_trace(path, known)
    return str(caught.value)


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("request_id", "", "a non-empty string"),
        ("request_id", 7, "a non-empty string"),
        ("tenant_id", None, "a non-empty string"),
        ("arrival_ms", -1, "a number >= 0 and <= 1e+15"),
        ("arrival_ms", True, "a number >= 0 and <= 1e+15"),
        ("arrival_ms", "5", "a number >= 0 and <= 1e+15"),
        ("prefill_tokens", 1.5, "an integer >= 0 and <= 2147483647"),
        ("prefill_tokens", -3, "an integer >= 0 and <= 2147483647"),
        ("decode_tokens", False, "an integer >= 0 and <= 2147483647"),
        ("priority_class", "realtime", "one of interactive, batch"),
        ("actual_prefill_tokens", -1, "an integer >= 0 and <= 2147483647"),
        ("actual_decode_tokens", 2.5, "an integer >= 0 and <= 2147483647"),
        # A count the core would refuse to settle:
        ("actual_decode_tokens", 2**31, "an integer >= 0 and <= 2147483647"),
        ("prefill_tokens", 3 * 10**12, "an integer >= 0 and <= 2147483647"),
        ("ttft_ms", -0.5, "a number >= 0 and <= 1e+15"),
        ("e2e_ms", "late", "a number >= 0 and <= 1e+15"),
        # Past it, a float no longer tells t from t + 1 ms: the replay's arithmetic would break.
        ("arrival_ms", 1e20, "a number >= 0 and <= 1e+15"),
        ("arrival_ms", math.nextafter(1e15, math.inf), "a number >= 0 and <= 1e+15"),
        ("ttft_ms", 2e15, "a number >= 0 and <= 1e+15"),
    ],
)
def test_a_field_that_breaks_its_rule(tmp_path: Path, field: str, value: object, rule: str) -> None:
    path = trace_file(tmp_path, json.dumps(GOOD), line(**{field: value}))
    assert refusal(path) == f"{path}:2: {field} must be {rule} (got {value!r})"


def test_the_largest_time_is_accepted(tmp_path: Path) -> None:
    # MAX_RECORD_MS itself, on every time field a request record carries.
    path = trace_file(tmp_path, line(arrival_ms=1e15, ttft_ms=1e15, e2e_ms=1e15, request_id="r1"))
    (record,) = read_trace(path)
    assert (record.request.arrival_ms, record.ttft_ms, record.e2e_ms) == (1e15, 1e15, 1e15)


def test_every_unknown_key_is_named(tmp_path: Path) -> None:
    path = trace_file(tmp_path, line(zeta=1, alpha=2))
    assert refusal(path) == f"{path}:1: unknown field(s) alpha, zeta"


def test_every_missing_key_is_named(tmp_path: Path) -> None:
    record = {k: v for k, v in GOOD.items() if k not in ("tenant_id", "decode_tokens")}
    path = trace_file(tmp_path, json.dumps(record))
    assert refusal(path) == f"{path}:1: missing field(s) tenant_id, decode_tokens"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "a record must be a JSON object"),
        ('"r1"', "a record must be a JSON object"),
        ('{"request_id": ', "invalid JSON"),
        ('{"request_id": "r1",}', "invalid JSON"),
    ],
)
def test_a_line_that_is_not_a_record(tmp_path: Path, text: str, message: str) -> None:
    path = trace_file(tmp_path, json.dumps(GOOD), "", text)
    assert refusal(path).startswith(f"{path}:3: {message}")


def test_nan_is_not_a_number_here(tmp_path: Path) -> None:
    path = trace_file(tmp_path, line().replace('"arrival_ms": 5', '"arrival_ms": NaN'))
    assert refusal(path).startswith(f"{path}:1: invalid JSON")


def test_duplicate_id_unknown_tenant_and_empty_file(tmp_path: Path) -> None:
    path = trace_file(tmp_path, json.dumps(GOOD), line(), json.dumps(GOOD))
    assert refusal(path) == f"{path}:3: duplicate request_id 'r1'"
    path = trace_file(tmp_path, json.dumps(GOOD), line(tenant_id="u"))
    assert refusal(path, {"t": None}) == (
        f"{path}:2: tenant_id 'u' is not in the tenants file (known: t)"
    )
    path = trace_file(tmp_path, "", "  ")
    assert refusal(path) == f"{path}: no records"


def test_blank_lines_nulls_and_decision_fields_are_accepted(tmp_path: Path) -> None:
    sidecar_record = {
        **GOOD,
        "request_id": "r3",
        "policy": "live",
        "status_code": 200,
        "reason": "admitted",
        "gate": "dispatch",
        "observed": {"max_wait_ms": 420.0},
        "dispatch_ms": None,
        "estimated_service_tokens": 140,
        "actual_decode_tokens": 7,
        "ttft_ms": 12.5,
    }
    path = trace_file(
        tmp_path, "", json.dumps(GOOD), "   ", line(ttft_ms=None), json.dumps(sidecar_record)
    )
    first, second, third = read_trace(path)
    assert first.request == Request("r1", "t", 5.0, 100, 10, "batch")
    assert second.ttft_ms is None
    assert second.actual_tokens() is None
    assert third.actual_tokens() == (100, 7)
    assert third.ttft_ms == 12.5


def test_the_docs_table_lists_the_schema() -> None:
    table = DOCS.read_text(encoding="utf-8").split("## Request records", 1)[1]
    table = table.split("\n\n", 2)[1]  # the first paragraph after the heading: the table
    cell = r"(?:[^|\\]|\\.)*\|"  # a cell; `\|` inside one is an escaped pipe
    rows = re.findall(rf"^\| `(\w+)`\s*\|{cell}{cell}\s*(yes|no)\s*\|", table, re.MULTILINE)
    assert rows == [(name, "yes") for name in REQUIRED_FIELDS] + [
        (name, "no") for name in OBSERVED_FIELDS
    ]


def test_scan_in_order_and_out_of_order(tmp_path: Path) -> None:
    ordered = trace_file(
        tmp_path, line(request_id="a", arrival_ms=3), line(request_id="b", arrival_ms=3)
    )
    scan = scan_trace(ordered)
    assert (scan.records, scan.in_order, scan.first_arrival_ms, scan.last_arrival_ms) == (
        2,
        True,
        3.0,
        3.0,
    )
    assert not scan.observed_usage
    # Same time, ids out of order; then an earlier arrival and a later one; one with usage.
    shuffled = trace_file(
        tmp_path,
        line(request_id="b", arrival_ms=3),
        line(request_id="a", arrival_ms=3),
        line(request_id="c", arrival_ms=9),
        line(request_id="d", arrival_ms=1, actual_decode_tokens=4),
    )
    scan = scan_trace(shuffled)
    assert (scan.records, scan.in_order, scan.first_arrival_ms, scan.last_arrival_ms) == (
        4,
        False,
        1.0,
        9.0,
    )
    assert scan.observed_usage


def test_stream_requests_reads_what_read_trace_reads(tmp_path: Path) -> None:
    path = trace_file(
        tmp_path,
        json.dumps(GOOD),
        "",
        line(request_id="r9", arrival_ms=2.25, priority_class="interactive", status_code=429),
    )
    assert list(stream_requests(path)) == [record.request for record in read_trace(path)]


def test_encode_decision_is_decision_to_json() -> None:
    decision = Decision(
        "r1", "t", "batch", 429, "shed_queue_wait_slo", "admission", 1234, 1e12, 0.1 + 0.2
    )
    decision.retry_after_ms = 1e-7
    decision.observed = {"predicted_wait_ms": 1e20, "max_wait_ms": 420.0}
    for policy in (None, "tokenfair"):
        written = encode_decision(decision, policy)
        assert written.endswith(b"\n")
        read = json.loads(written)
        assert list(read.items()) == list(decision_to_json(decision, policy).items())
    decision.observed["budget_wait_ms"] = math.inf  # JSON has no inf: json's Infinity, read back
    assert json.loads(encode_decision(decision))["observed"]["budget_wait_ms"] == math.inf


def _config() -> Config:
    return build_config(PolicyConfig(), [TenantConfig("t", 1.0, 10**9, 10**9, "interactive")])


def test_replay_refuses_arrivals_out_of_order() -> None:
    arrivals: list[Arrival] = [
        (Request("b", "t", 0.0, 10, 1, "interactive"), None, None),
        (Request("a", "t", 0.0, 10, 1, "interactive"), None, None),
    ]
    with pytest.raises(ValueError, match="out of \\(arrival_ms, request_id\\) order at 'a'"):
        list(replay(_config(), arrivals, "tokenfair"))


def _live(kind: type) -> int:
    return sum(1 for o in gc.get_objects() if type(o) is kind)


def test_replay_holds_the_backlog_not_the_trace() -> None:
    # 20,000 requests of 100 service tokens every 4 ms against 45 tokens/ms: the server keeps
    # up. Counted every 1,000 decisions, live `Decision`s and `Request`s stay bounded by what
    # the core still tracks (running, KV still resident, a deadline not yet passed: ~120 at
    # 4 ms apart with a 420 ms wait limit), far below the 20,000 that pass through: a replay
    # that kept them (a list) would hold 20,000 of each at the end.
    def arrivals() -> Iterator[Arrival]:
        for i in range(20_000):
            yield (Request(f"r{i:05d}", "t", 4.0 * i, 60, 10, "interactive"), None, None)

    peaks = {Decision: 0, Request: 0}
    seen = 0
    for decision, _ in replay(_config(), arrivals(), "tokenfair"):
        assert decision.admitted
        seen += 1
        if seen % 1_000 == 0:
            for kind in peaks:
                peaks[kind] = max(peaks[kind], _live(kind))
        del decision
    assert seen == 20_000
    assert peaks[Decision] < 1_000, peaks
    assert peaks[Request] < 1_000, peaks


@pytest.mark.parametrize(
    ("lines", "known"),
    [
        ((json.dumps(GOOD), line(prefill_tokens=-3)), None),  # a field breaks its rule
        ((json.dumps(GOOD), line(extra=1)), None),  # an unknown key
        ((json.dumps({k: v for k, v in GOOD.items() if k != "tenant_id"}),), None),
        (("", "[1, 2]"), None),  # not an object
        ((json.dumps(GOOD), "{nope"), None),  # invalid JSON
        ((json.dumps(GOOD), line(), json.dumps(GOOD)), None),  # a duplicate id
        ((json.dumps(GOOD), line(tenant_id="u")), {"t": None}),  # an unknown tenant
        (("", "  "), None),  # no records
    ],
)
def test_scan_refuses_what_the_stream_refuses_in_its_words(
    tmp_path: Path, lines: tuple[str, ...], known: dict[str, object] | None
) -> None:
    # `scan_trace` validates through `iter_trace_lines`: the same error, naming the same
    # line, for every kind of refusal.
    path = trace_file(tmp_path, *lines)
    with pytest.raises(TraceError) as scanned:
        scan_trace(path, known)
    assert str(scanned.value) == refusal(path, known)


def test_scan_of_a_file_that_cannot_be_read(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(TraceError) as scanned:
        scan_trace(missing)
    assert str(scanned.value) == refusal(missing)
    with pytest.raises(TraceError) as streamed:
        list(stream_arrivals(missing))
    assert str(streamed.value) == str(scanned.value)


def test_stream_arrivals_are_the_requests_as_the_replay_takes_them(tmp_path: Path) -> None:
    path = trace_file(
        tmp_path,
        json.dumps(GOOD),
        "",
        "   ",
        line(request_id="r9", arrival_ms=2.25, priority_class="interactive", status_code=429),
    )
    assert list(stream_arrivals(path)) == [(r, None, None) for r in stream_requests(path)]
    changed = trace_file(tmp_path, json.dumps(GOOD), line(prefill_tokens="x"))
    with pytest.raises(TraceError, match=r":2: "):
        list(stream_arrivals(changed))
