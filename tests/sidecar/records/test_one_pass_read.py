"""The one-pass read of a trace (``records.stream_validated``) and the fairness tally that takes
its window as it grows (``FairnessTally`` given the ``TraceReading``).

Behaviours under test:

* on random traces, clean and broken (a bad field, an unknown key, a repeated id near or far, an
  unknown tenant, blank lines, lines out of order, recorded usage, a sidecar's outcome fields),
  the one pass followed, when it stops at a line out of order, by the validating read the
  command falls back to, refuses exactly what the validating scan (``scan_trace``) refuses, in
  the same words; and accepts what it accepts: the same arrivals as the validated records, and
  the scan's count, first and last arrival and whether usage is recorded;
* two ids that share a hash without being equal are not refused (the check of repeated ids by
  hash reads the file again to make sure), whatever line the pass is at;
* a line without observed or outcome keys is yielded as it was decoded (a ``Request``); one with
  them as a plain ``Request`` or the priced arrival, never as the wide line;
* a pass dropped before the end of its file closes the file (no ``ResourceWarning``: the compiled
  loop runs no ``finally`` then), and a file that cannot be read is one error, without the
  ``OSError`` chained to it;
* the tally given the reading reports what the tally given the known window reports, over real
  replays streamed from the file (arrivals spread out, all at one instant, a backlog that drains
  long after the last arrival), and over dispatches the tally sees before the reading has
  reached them (kept aside, then counted or not by the final window); its report refuses to be
  made before the trace has been read to its end.
"""

from __future__ import annotations

import gc
import json
import random
import warnings
from pathlib import Path

import pytest

from tokenfair.config import PolicyConfig, TenantConfig, build_config
from tokenfair.core import Decision, Request
from tokenfair.core.cost import CostModel
from tokenfair.records import codec as records
from tokenfair.records.codec import (
    TraceError,
    TraceLine,
    TraceOutOfOrder,
    TraceReading,
    TraceRecord,
    TraceRequest,
    iter_trace_lines,
    scan_trace,
    stream_validated,
)
from tokenfair.sim.fairness import FairnessTally, decision_size
from tokenfair.sim.simulator import Arrival, replay

TENANTS = ("tenant_a", "tenant_b", "tenant_c")
KNOWN = dict.fromkeys(TENANTS)
COST = CostModel.from_policy(PolicyConfig())


def priced(line: TraceLine) -> Arrival:
    used = TraceRecord.from_line(line).actual_tokens()
    assert used is not None
    return (TraceRecord.from_line(line).request, COST.service_tokens(*used), COST.kv_blocks(*used))


def random_lines(rng: random.Random, count: int) -> list[dict[str, object]]:
    lines: list[dict[str, object]] = []
    arrival_ms = 0.0
    for i in range(count):
        arrival_ms += rng.choice((0.0, 0.0, 0.5, 2.0, 7.25))
        line: dict[str, object] = {
            "request_id": f"r{i:04d}",
            "tenant_id": rng.choice(TENANTS),
            "arrival_ms": arrival_ms,
            "prefill_tokens": rng.randint(0, 3000),
            "decode_tokens": rng.randint(0, 400),
            "priority_class": rng.choice(("interactive", "batch")),
        }
        if rng.random() < 0.2:
            line["actual_decode_tokens"] = rng.randint(0, 800)
        if rng.random() < 0.1:
            line["status_code"] = 200  # an outcome field of a sidecar's record: skipped
            line["ttft_ms"] = rng.random() * 50
        lines.append(line)
    return lines


def broken(rng: random.Random, lines: list[dict[str, object]]) -> list[str]:
    """``lines`` as text with up to three random faults (or none)."""
    text = [json.dumps(line) for line in lines]
    for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
        records_at = [i for i, t in enumerate(text) if t.strip()]
        at = rng.choice(records_at)
        fault = rng.choice(("field", "key", "repeat", "repeat_near", "tenant", "order", "blank"))
        data = json.loads(text[at])
        if fault == "field":
            data[rng.choice(("prefill_tokens", "arrival_ms", "request_id"))] = -1
        elif fault == "key":
            data["zeta"] = 1
        elif fault == "repeat":
            data["request_id"] = json.loads(text[rng.choice(records_at)])["request_id"]
        elif fault == "repeat_near" and at > 0 and text[at - 1].strip():
            data["request_id"] = json.loads(text[at - 1])["request_id"]
        elif fault == "tenant":
            data["tenant_id"] = "tenant_nobody"
        elif fault == "order" and at > 0:
            text[at - 1], text[at] = text[at], text[at - 1]
            continue
        elif fault == "blank":
            text.insert(at, "   ")
            continue
        text[at] = json.dumps(data)
    return text


def one_pass(path: Path) -> tuple[list[Arrival] | str, TraceReading]:
    """What the command gets from the one pass: the arrivals, or the error it reports (after
    the validating read it falls back to when the pass stops at a line out of order)."""
    reading = TraceReading()
    try:
        return list(stream_validated(path, KNOWN, reading, priced)), reading
    except TraceOutOfOrder:
        try:
            list(iter_trace_lines(path, KNOWN))  # `_Trace.hold_sorted`
        except TraceError as exc:
            return str(exc), reading
        return "out of order", reading
    except TraceError as exc:
        return str(exc), reading


def reference(path: Path) -> list[Arrival] | str:
    try:
        scan = scan_trace(path, KNOWN)
    except TraceError as exc:
        return str(exc)
    if not scan.in_order:
        return "out of order"
    arrivals: list[Arrival] = []
    for line in iter_trace_lines(path, KNOWN):
        record = TraceRecord.from_line(line)
        arrivals.append(priced(line) if record.actual_tokens() else (record.request, None, None))
    return arrivals


def as_fields(arrivals: list[Arrival]) -> list[tuple[object, ...]]:
    return [
        (*(getattr(r, name) for name in records.REQUIRED_FIELDS), used, kv)
        for r, used, kv in arrivals
    ]


@pytest.mark.parametrize("seed", range(150))
def test_the_one_pass_refuses_and_accepts_what_the_scan_does(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(broken(rng, random_lines(rng, rng.randint(1, 60)))) + "\n")
    got, reading = one_pass(path)
    expected = reference(path)
    if isinstance(expected, str):
        assert got == expected
        return
    assert isinstance(got, list)
    assert as_fields(got) == as_fields(expected)
    scan = scan_trace(path, KNOWN)
    assert (reading.records, reading.first_arrival_ms, reading.last_arrival_ms) == (
        scan.records,
        scan.first_arrival_ms,
        scan.last_arrival_ms,
    )
    assert reading.observed_usage == scan.observed_usage
    assert reading.complete


def test_an_empty_file_and_a_missing_one(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n \n")
    assert one_pass(empty)[0] == f"{empty}: no records"
    missing = tmp_path / "missing.jsonl"
    assert one_pass(missing)[0] == f"{missing}: cannot read (No such file or directory)"


def test_ids_that_only_share_a_hash_are_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every check of the hashes answers "two are equal": the pass reads the file again to find
    # the repeated id, finds none, and goes on, at every line and at the end.
    rng = random.Random(1)
    lines = random_lines(rng, 40)
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    monkeypatch.setattr(records._StreamHooks, "hashes_repeated", lambda self: True)
    got, reading = one_pass(path)
    assert isinstance(got, list)
    assert reading.complete
    expected = reference(path)
    assert isinstance(expected, list)
    assert as_fields(got) == as_fields(expected)
    # A real repeat is still found, and a later error does not hide it.
    lines[30]["request_id"] = lines[3]["request_id"]
    lines[35]["tenant_id"] = "tenant_nobody"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert one_pass(path)[0] == f"{path}:31: duplicate request_id {lines[3]['request_id']!r}"


def test_what_the_pass_yields_is_a_narrow_request(tmp_path: Path) -> None:
    plain = {"request_id": "a", "tenant_id": "tenant_a", "arrival_ms": 1, "prefill_tokens": 5}
    plain |= {"decode_tokens": 2, "priority_class": "batch"}
    path = tmp_path / "trace.jsonl"
    lines = [
        plain,
        {**plain, "request_id": "b", "ttft_ms": 3.0, "reason": "admitted"},
        {**plain, "request_id": "c", "actual_decode_tokens": 9},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    got, _ = one_pass(path)
    assert isinstance(got, list)
    kinds = [type(request) for request, _, _ in got]
    assert kinds == [TraceRequest, Request, Request]
    assert all(isinstance(request, Request) for request, _, _ in got)
    assert got[2][1] == COST.service_tokens(5, 9)


# --- the tally whose window grows with the read ------------------------------------------------

CONFIG = build_config(
    PolicyConfig(max_batch_wait_ms=1e12, max_interactive_wait_ms=1e12),
    [
        TenantConfig(tenant, 1.0 + i, 40_000, 200_000, "batch" if i else "interactive")
        for i, tenant in enumerate(TENANTS)
    ],
)


def spread(rng: random.Random, count: int, step_ms: tuple[float, ...]) -> list[dict[str, object]]:
    lines: list[dict[str, object]] = []
    arrival_ms = rng.random() * 10
    for i in range(count):
        arrival_ms += rng.choice(step_ms)
        tenant = rng.randrange(3)
        lines.append(
            {
                "request_id": f"r{i:04d}",
                "tenant_id": TENANTS[tenant],
                "arrival_ms": arrival_ms,
                "prefill_tokens": rng.randint(50, 4000),
                "decode_tokens": rng.randint(1, 500),
                "priority_class": "batch" if tenant else "interactive",
            }
        )
    return lines


@pytest.mark.parametrize("policy", ["service_token_drr_with_admission", "tokenfair"])
@pytest.mark.parametrize(
    "step_ms",
    [(0.0, 1.0, 5.0), (0.0,), (50.0, 200.0), (0.0, 0.1)],
    ids=["spread", "one instant", "sparse", "backlog"],
)
def test_the_growing_window_reports_what_the_known_one_does(
    tmp_path: Path, policy: str, step_ms: tuple[float, ...]
) -> None:
    path = tmp_path / "trace.jsonl"
    for seed in range(4):
        lines = spread(random.Random(seed), 300, step_ms)
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        reading = TraceReading()
        growing = FairnessTally(CONFIG, reading)
        decisions = []
        arrivals = stream_validated(path, KNOWN, reading, priced)
        for decision, used in replay(CONFIG, arrivals, policy):
            growing.add(decision, decision_size(decision, used))
            decisions.append((decision, used))
        first, last = lines[0]["arrival_ms"], lines[-1]["arrival_ms"]
        assert isinstance(first, float)
        assert isinstance(last, float)
        known = FairnessTally(CONFIG, (first, last if last > first else None))
        for decision, used in decisions:
            known.add(decision, decision_size(decision, used))
        assert growing.report() == known.report()


def dispatched(request_id: str, arrival_ms: float, dispatch_ms: float) -> Decision:
    return Decision(
        request_id, "tenant_b", "batch", 200, "admitted", "dispatch", 1000, arrival_ms,
        0.1, dispatch_ms - arrival_ms, 1.0, dispatch_ms, None, 1000,
    )  # fmt: skip


@pytest.mark.parametrize(("last_ms", "counted"), [(5.0, 1), (10.0, 2), (40.0, 3), (0.0, 3)])
def test_dispatches_ahead_of_the_read_wait_for_the_window(last_ms: float, counted: int) -> None:
    reading = TraceReading(first_arrival_ms=0.0, last_arrival_ms=0.0)
    tally = FairnessTally(CONFIG, reading)
    # Seen while the latest arrival read is at 0 ms: one at 0 (counted), two later (aside).
    for request_id, dispatch_ms in (("a", 0.0), ("b", 10.0), ("c", 40.0)):
        tally.add(dispatched(request_id, 0.0, dispatch_ms), 1000)
    with pytest.raises(ValueError, match="has not been read to its end"):
        tally.report()
    reading.last_arrival_ms, reading.records, reading.complete = last_ms, 3, True
    report = tally.report()
    # The window is [0, last]; all at one instant (last 0): every dispatch counts.
    assert report.dispatched_service_tokens == counted * 1000
    if last_ms:
        assert report.window_ms == (0.0, last_ms)


def test_a_dispatch_after_the_read_has_ended_is_counted_by_the_window() -> None:
    reading = TraceReading(first_arrival_ms=0.0, last_arrival_ms=20.0, complete=True)
    tally = FairnessTally(CONFIG, reading)
    for request_id, dispatch_ms in (("a", 5.0), ("b", 25.0), ("c", 20.0)):
        tally.add(dispatched(request_id, 0.0, dispatch_ms), 1000)
    assert tally.report().dispatched_service_tokens == 2000


def test_a_pass_dropped_before_the_end_closes_its_file(tmp_path: Path) -> None:
    lines = random_lines(random.Random(3), 20)
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reading = TraceReading()
        arrivals = stream_validated(path, KNOWN, reading, priced)
        first = next(arrivals)
        del arrivals  # as the command does when the replay raises (a repeated id met queued)
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert first[0].request_id == lines[0]["request_id"]
    assert reading == TraceReading(0, first[0].arrival_ms, first[0].arrival_ms)


def test_a_file_that_cannot_be_read_is_one_error(tmp_path: Path) -> None:
    for path, rule in (
        (tmp_path / "missing.jsonl", "cannot read"),
        (tmp_path, r"must be a regular file \(it is a directory\)"),
    ):
        with pytest.raises(TraceError, match=rule) as refused:
            list(stream_validated(path, KNOWN, TraceReading(), priced))
        assert refused.value.__suppress_context__  # `from None`: no OSError chained above it
