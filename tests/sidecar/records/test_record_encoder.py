"""The one schema and encoder of record lines (``records/codec.py``), and the writers that use it.

Behaviours under test:

* the fast encoders (``encode_record_line``, ``encode_trace_line``: msgspec) write the plain
  reference's bytes (``plain_line``: ``json.dumps`` compact, ASCII only) byte for byte, over
  generated records: any text (non-ASCII, DEL, control characters, lone surrogates), every
  reason, None in each optional field, floats of every magnitude (0.1, 1e-7, 1e-5, 1e16, -0.0,
  inf, nan), ints beyond 64 bits, any ``observed``; and over a fixed list of the edge values;
* the schema: ``RecordLine`` begins with ``Decision``'s fields in their order, the request
  fields follow and are left out when None, ``policy`` comes first when given; a decision's
  line is ``decision_to_json`` and a trace record's line is ``TraceRecord.to_json``;
* every writer goes through it: ``encode_decision`` (``simulate --records``), the sidecar's
  ``encode_record`` and loadgen's ``record_line`` write ``plain_line`` of their line, and
  ``dump_trace`` writes ``plain_line`` of each record's ``TraceLine``.
"""

from __future__ import annotations

import io
import json
import math
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace
from repo_paths import REPO_ROOT

from tokenfair.core import Decision, Request
from tokenfair.loadgen import (
    CLIENT_TIMEOUT,
    CONNECTION_ERROR,
    NOT_SENT,
    LoadgenSettings,
    Observation,
    record_line,
    to_decision,
)
from tokenfair.records import codec as records
from tokenfair.records.codec import (
    DECISION_FIELDS,
    RECORD_FIELDS,
    RecordLine,
    TraceLine,
    TraceRecord,
    decision_line,
    decision_to_json,
    dump_trace,
    encode_decision,
    encode_record_line,
    encode_trace_line,
    line_fields,
    plain_line,
)
from tokenfair.records.live import Usage, encode_record, request_record

DOCS = REPO_ROOT / "docs" / "records.md"


def _documented_reasons() -> list[str]:
    """Every reason docs/records.md's decision table names, and loadgen's."""
    row = next(line for line in DOCS.read_text(encoding="utf-8").splitlines()
               if line.startswith("| `reason`"))  # fmt: skip
    words = [w for w in re.findall(r"`([^`]+)`", row) if re.fullmatch(r"[a-z_]+", w)]
    return sorted({*words[1:], CLIENT_TIMEOUT, CONNECTION_ERROR, NOT_SENT})


REASONS = _documented_reasons()
EDGE_FLOATS = [0.0, -0.0, 0.1, 1e-7, 1e-5, 9.99e-5, 1e-4, 2.5, 1e15, 1e16, 1.5e17, 1e300,
               5e-324, -3.25, 0.1 + 0.2, math.inf, -math.inf, math.nan]  # fmt: skip
EDGE_TEXT = ["tenant_chat", "é-ü", "日本", 'a"b\\c', "tab\tnl\n", "del\x7f", "ctl\x01\x1f",
             "emoji-😀", "\u2028", "/", "lone\udc80"]  # fmt: skip

_TEXT = st.text(min_size=1, max_size=10) | st.sampled_from(EDGE_TEXT)
_FLOAT = (
    st.floats()  # any magnitude, inf and nan included
    | st.sampled_from(EDGE_FLOATS)
    | st.integers(0, 10**9).map(lambda n: n / 1000)  # what a clock rounded to µs gives
    | st.integers(-(10**20), 10**20)  # an int where a float is declared (json writes it alike)
)
_COUNT = st.integers(0, 2**31 - 1) | st.integers(0, 10**30)


@st.composite
def record_lines(draw: st.DrawFn) -> RecordLine:
    def maybe(strategy: st.SearchStrategy[Any]) -> Any:
        return draw(st.none() | strategy)

    return RecordLine(
        request_id=draw(_TEXT),
        tenant_id=draw(_TEXT),
        priority_class=draw(st.sampled_from(["interactive", "batch"])),
        status_code=draw(st.sampled_from([0, 200, 429, 499, 500, 502, 503, 504])),
        reason=draw(st.sampled_from(REASONS)),
        gate=draw(st.sampled_from(["admission", "dispatch", "queue", "client", "http"])),
        service_tokens=draw(_COUNT),
        arrival_ms=draw(_FLOAT),
        kv_occupancy_ratio=draw(_FLOAT),
        queue_wait_ms=draw(_FLOAT),
        ttft_ms=draw(_FLOAT),
        dispatch_ms=maybe(_FLOAT),
        retry_after_ms=maybe(_FLOAT),
        actual_service_tokens=maybe(_COUNT),
        observed=draw(st.dictionaries(_TEXT, _FLOAT, max_size=3)),
        prefill_tokens=maybe(_COUNT),
        decode_tokens=maybe(_COUNT),
        actual_prefill_tokens=maybe(_COUNT),
        actual_decode_tokens=maybe(_COUNT),
        e2e_ms=maybe(_FLOAT),
    )


@st.composite
def trace_lines(draw: st.DrawFn) -> TraceLine:
    return TraceLine(
        draw(_TEXT), draw(_TEXT), draw(_FLOAT), draw(_COUNT), draw(_COUNT),
        draw(st.sampled_from(["interactive", "batch"])), draw(st.none() | _COUNT),
        draw(st.none() | _COUNT), draw(st.none() | _FLOAT), draw(st.none() | _FLOAT),
    )  # fmt: skip


def _reference(line: RecordLine | TraceLine, policy: str | None = None) -> bytes:
    """What the writers wrote before the one encoder: ``json.dumps`` of the record's dict."""
    return json.dumps(line_fields(line, policy), separators=(",", ":")).encode()


@settings(max_examples=600, deadline=None)
@given(line=record_lines(), policy=st.none() | _TEXT)
def test_the_fast_record_encoder_is_the_plain_one_byte_for_byte(
    line: RecordLine, policy: str | None
) -> None:
    expected = _reference(line, policy)
    assert plain_line(line, policy) == expected
    assert encode_record_line(line, policy) == expected


@settings(max_examples=300, deadline=None)
@given(line=trace_lines())
def test_the_fast_trace_encoder_is_the_plain_one_byte_for_byte(line: TraceLine) -> None:
    assert encode_trace_line(line) == plain_line(line) == _reference(line)


@settings(max_examples=300, deadline=None)
@given(line=record_lines(), usage=st.tuples(st.none() | _COUNT, st.none() | _COUNT,
                                            st.none() | _FLOAT, st.none() | _FLOAT))  # fmt: skip
def test_the_sidecars_and_loadgens_lines_are_their_dicts_key_by_key(
    line: RecordLine, usage: tuple[int | None, int | None, float | None, float | None]
) -> None:
    """The writers build their line positionally: checked against the dicts they built key by
    key before the one encoder (a decision record, then the request fields)."""
    decision = Decision(*(getattr(line, name) for name in DECISION_FIELDS))
    request = Request(line.request_id, line.tenant_id, line.arrival_ms, 7, 9, "batch")
    # The sidecar: the outcome the client saw, measured times rounded to 0.01 ms.
    prompt, completion, ttft_ms, e2e_ms = usage
    expected: dict[str, Any] = decision_to_json(decision, "tokenfair")
    expected |= {"prefill_tokens": 7, "decode_tokens": 9, "status_code": 502, "reason": "x"}
    if prompt is not None:
        expected["actual_prefill_tokens"] = prompt
    if completion is not None:
        expected["actual_decode_tokens"] = completion
    if ttft_ms is not None:
        expected["ttft_ms"] = round(ttft_ms, 2)
    if e2e_ms is not None:
        expected["e2e_ms"] = round(e2e_ms, 2)
    got = request_record(request, decision, "tokenfair", status_code=502, reason="x",
                         usage=Usage(*usage))  # fmt: skip
    assert json.dumps(got) == json.dumps(expected)  # (keys, order and values; nan == nan)
    # loadgen: the decision as it is, usage from the response, e2e_ms from `observed`.
    observation = Observation(request, 0.0, prompt_tokens=prompt, completion_tokens=completion)
    expected = decision_to_json(decision, "live") | {"prefill_tokens": 7, "decode_tokens": 9}
    if prompt is not None:
        expected["actual_prefill_tokens"] = prompt
    if completion is not None:
        expected["actual_decode_tokens"] = completion
    if "e2e_ms" in decision.observed:
        expected["e2e_ms"] = decision.observed["e2e_ms"]
    got = line_fields(record_line(observation, decision), "live")
    assert json.dumps(got) == json.dumps(expected)


def test_every_edge_value_and_reason_takes_the_right_path() -> None:
    """Each edge value alone in an otherwise plain record: same bytes as the reference (so the
    fast path's checks, not luck in the generated data, cover each of them)."""
    base = RecordLine("r", "t", "batch", 200, "admitted", "dispatch", 10, 1.5, 0.5, 0.0, 2.0,
                      None, None, None, {})  # fmt: skip
    variants = [replace(base, reason=reason) for reason in REASONS]
    for value in EDGE_FLOATS:
        variants += [replace(base, arrival_ms=value),
                     replace(base, observed={"k": value}),
                     replace(base, e2e_ms=value)]  # fmt: skip
    for text in EDGE_TEXT:
        variants += [replace(base, request_id=text),
                     replace(base, observed={text: 1.0})]  # fmt: skip
    for line in variants:
        for policy in (None, "tokenfair", "pól"):
            assert encode_record_line(line, policy) == _reference(line, policy), (line, policy)


def test_an_ordinary_record_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks do not send every record to the plain encoder (the byte tests would pass
    then too): an ASCII record of in-range numbers never calls it, an edge one does."""
    calls: list[object] = []
    plain = records.plain_line

    def counted(line: RecordLine | TraceLine, policy: str | None = None) -> bytes:
        calls.append(line)
        return plain(line, policy)

    monkeypatch.setattr(records, "plain_line", counted)
    line = RecordLine("req-1", "tenant_a", "batch", 200, "admitted", "dispatch", 1836, 12345.678,
                      0.4123, 0.0, 45.67, 12358.018, None, 1840, {"send_lag_ms": 0.25},
                      False, 812, 256, 812, None, 312.35)  # fmt: skip
    encode_record_line(line, "tokenfair")
    encode_trace_line(TraceRecord(Request("r", "t", 1.5, 1, 2, "batch"), 1, 2, 0.5, 0.75).to_line())
    assert calls == []
    encode_record_line(replace(line, queue_wait_ms=1e-5), "tokenfair")
    encode_record_line(replace(line, tenant_id="é"), "tokenfair")
    encode_record_line(line, "pól")
    assert len(calls) == 3


def test_the_schema_is_decision_then_request_fields() -> None:
    names = [f.name for f in RECORD_FIELDS]
    assert tuple(names[: len(DECISION_FIELDS)]) == DECISION_FIELDS
    assert names[len(DECISION_FIELDS) :] == [
        "prefill_tokens", "decode_tokens", "actual_prefill_tokens", "actual_decode_tokens",
        "e2e_ms",
    ]  # fmt: skip
    decision = Decision("r", "t", "interactive", 429, "shed_kv_watermark", "admission", 10, 5.0,
                        0.8, observed={"kv_watermark": 0.65})  # fmt: skip
    line = decision_line(decision)
    assert list(line_fields(line, "p").items()) == list(decision_to_json(decision, "p").items())
    assert encode_decision(decision, "p") == plain_line(line, "p") + b"\n"
    # `would_refuse` (shadow mode) is written only when set.
    assert list(json.loads(encode_decision(decision))) == list(DECISION_FIELDS)[:-1]
    decision.would_refuse = True
    assert list(json.loads(encode_decision(decision))) == list(DECISION_FIELDS)


def test_every_writer_writes_the_schema_by_the_one_encoder() -> None:
    request = Request("r1", "tenant-é", 12.5, 100, 20, "batch")
    decision = Decision("r1", "tenant-é", "batch", 200, "admitted", "dispatch", 180, 12.5, 0.25,
                        1e-7, 30.0, 12.5, None, 190, {"borrowed_service_tokens": 3.0})  # fmt: skip
    # The sidecar: its line is the decision with the outcome the client saw and the usage.
    usage = Usage(101, 22, 40.123, 1e16)
    line_text = encode_record(request, decision, "tokenfair", status_code=502,
                              reason="upstream_error", usage=usage)  # fmt: skip
    shape = request_record(request, decision, "tokenfair", status_code=502,
                           reason="upstream_error", usage=usage)  # fmt: skip
    assert line_text.encode() == json.dumps(shape, separators=(",", ":")).encode()
    assert list(shape)[-5:] == [
        "prefill_tokens", "decode_tokens", "actual_prefill_tokens", "actual_decode_tokens",
        "e2e_ms",
    ]  # fmt: skip
    assert (shape["status_code"], shape["ttft_ms"], shape["e2e_ms"]) == (502, 40.12, 1e16)
    # loadgen: e2e_ms from the decision's observed values, usage from the response.
    observation = Observation(request, 0.0, sent_offset_ms=1.0, status_code=200,
                              reason="admitted", ttft_wall_ms=5.0, e2e_wall_ms=9.0,
                              prompt_tokens=99)  # fmt: skip
    live = to_decision(observation, LoadgenSettings("http://127.0.0.1:1"))
    line = record_line(observation, live)
    fields = line_fields(line, "live")
    assert fields["e2e_ms"] == 9.0
    assert fields["actual_prefill_tokens"] == 99
    assert "actual_decode_tokens" not in fields
    assert encode_record_line(line, "live") == plain_line(line, "live")
    # A trace: each record's TraceLine, in the request table's order.
    records = [TraceRecord(request), TraceRecord(request, 100, None, 1e-5, 3.0)]
    out = io.StringIO()
    dump_trace(out, records)
    lines = out.getvalue().splitlines()
    assert [json.loads(text) for text in lines] == [r.to_json() for r in records]
    assert [text.encode() for text in lines] == [plain_line(r.to_line()) for r in records]
    assert list(json.loads(lines[1])) == [
        "request_id", "tenant_id", "arrival_ms", "prefill_tokens", "decode_tokens",
        "priority_class", "actual_prefill_tokens", "ttft_ms", "e2e_ms",
    ]  # fmt: skip
