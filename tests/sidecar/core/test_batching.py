"""The batching engine model (``core/batching.py``) and the tokenfair policy's use of it.

Behaviours under test:

- ``BatchingCurve``: ``X(1) = R / G`` and ``X(S) = R`` for every ``S`` and ``G``; ``G = 1`` is a
  fixed throughput shared by the batch, ``G = S`` a throughput linear in the batch; out-of-range
  coefficients are refused; ``S = 1`` is the serial server.
- ``RunningWork``: processor sharing worked out by hand (equal requests end together; a short
  one leaves first and the others speed up; a request sent beyond the batch waits for a slot);
  the forecast's departures, remaining and attained service; ``expected_tokens`` is 0 when
  nothing is held.
- Admission with ``maxBatchRequests > 1``: a request that finds a free slot and nothing of its
  lane ahead is predicted to wait 0 however much runs (a serial model predicted the running
  work); with every slot busy it waits for the first forecast end.
- ``observe_engine_kv``: the KV gates see the engine's report plus every running request's
  growth to its reservation (decode growth is never free): a request that fits the engine now
  but not once the running ones have decoded waits; blocks the engine does not hold (a shared
  prefix) let one start; that credit leaves with the requests it may have come from (up to
  each one's reservation), blocks held beyond the books stay until the next report, and no
  report means the books alone.
- with a decode allowance (``kvDecodeBooking: engine``): a request dispatched is booked at its
  prompt and the allowance, not its ``max_tokens`` (the books keep the reservation); each
  request's credit (the reservation the gates do not count) is its own and leaves exactly when
  it ends, whatever the correction's sign: blocks another client holds stay counted however
  many short requests end between two reports, and, over random dispatches, relays, endings,
  fresh and stale reports, the gates never see fewer blocks than the engine's last report less
  what the requests ended since held in it; no report means every reservation in full again;
  the lesson's policies ignore the allowance (up-front booking whatever the setting).
"""

from __future__ import annotations

import math

import pytest

from tokenfair.config import PolicyConfig, PriorityClass, TenantConfig, build_config
from tokenfair.core import Books, Request, make_scheduler
from tokenfair.core.batching import BatchingCurve, RunningWork
from tokenfair.core.tokenfair import TokenfairScheduler


def test_the_curve_passes_through_one_request_alone_and_the_full_batch() -> None:
    for batch in (1, 2, 8, 64):
        for gain in {1.0, math.sqrt(batch), float(batch)}:
            curve = BatchingCurve.of(batch, 40.0, 40.0 / gain)
            assert curve.throughput(1) == pytest.approx(40.0 / gain)
            assert curve.throughput(batch) == pytest.approx(40.0)
            assert curve.throughput(batch + 5) == pytest.approx(40.0)  # beyond S: it queues
            speeds = [curve.request_speed(c) for c in range(1, batch + 1)]
            assert speeds == sorted(speeds, reverse=True)  # a bigger batch never speeds one up


def test_gain_one_shares_a_fixed_throughput_and_gain_s_scales_linearly() -> None:
    shared = BatchingCurve.of(4, 20.0, 20.0)  # G = 1: a = 0, each of c runs at R / c
    assert shared.per_request_ms == pytest.approx(0.0)
    assert [shared.request_speed(c) for c in (1, 2, 4)] == pytest.approx([20.0, 10.0, 5.0])
    linear = BatchingCurve.of(4, 20.0, 5.0)  # G = S: b = 0, every request at r1 = 5
    assert linear.per_batched_request_ms == pytest.approx(0.0)
    assert [linear.throughput(c) for c in (1, 2, 4)] == pytest.approx([5.0, 10.0, 20.0])
    # In between (G = 2): 1 / r1 = a + b = 0.1, S / R = a + 4 b = 0.2 -> b = 1/30, a = 1/15.
    middle = BatchingCurve.of(4, 20.0, 10.0)
    assert middle.per_batched_request_ms == pytest.approx(1 / 30)
    assert middle.per_request_ms == pytest.approx(1 / 15)
    assert middle.throughput(2) == pytest.approx(2 / (1 / 15 + 2 / 30))  # 15 tokens per ms
    assert middle.slowdown(4) == pytest.approx(10.0 / 5.0)


@pytest.mark.parametrize(
    ("batch", "single"), [(4, 4.9), (4, 20.5), (0, 1.0), (2, -1.0), (2, math.nan)]
)
def test_coefficients_out_of_range_are_refused(batch: int, single: float) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the message is checked below for one case
        BatchingCurve.of(batch, 20.0, single)
    with pytest.raises(ValueError, match=r"in \[R / S, R\] = \[5, 20\]"):
        BatchingCurve.of(4, 20.0, 4.0)


def ends(work: RunningWork, now_ms: float) -> list[tuple[float, str]]:
    """The forecast's departures, times rounded to 1e-9 ms (float noise aside)."""
    return [(round(in_ms, 9), request_id) for in_ms, request_id in work.departures(now_ms)]


def test_processor_sharing_by_hand() -> None:
    # S = 2, G = 1, R = 10: each of two runs at 5 tokens per ms.
    work = RunningWork(BatchingCurve.of(2, 10.0, 10.0))
    work.start("a", 100.0, 0.0)
    work.start("b", 100.0, 0.0)
    work.start("c", 50.0, 0.0)  # beyond the batch: waits for a slot
    assert (work.running, work.waiting) == (2, 1)
    # a and b end together at 100 / 5 = 20 ms.
    assert work.next_departure_ms(0.0) == pytest.approx(20.0)
    assert ends(work, 0.0) == [(20.0, "a"), (20.0, "b")]
    assert work.remaining_tokens("a", 10.0) == pytest.approx(50.0)
    assert work.attained_tokens("b", 10.0) == pytest.approx(50.0)
    assert work.remaining_tokens("c", 10.0) == pytest.approx(50.0)  # not started: all of it
    work.finish("a", 20.0, 100.0)  # c takes a's slot at 20 ms
    assert (work.running, work.waiting) == (2, 0)
    work.finish("b", 20.0, 100.0)
    # c alone runs at 10 per ms: its 50 tokens take 5 ms.
    assert work.next_departure_ms(20.0) == pytest.approx(5.0)
    work.finish("c", 25.0, 50.0)
    assert work.running == 0
    assert work.expected_tokens == 0.0
    assert work.next_departure_ms(25.0) == math.inf


def test_a_short_request_leaves_first_and_the_other_speeds_up() -> None:
    # S = 2, G = 2, R = 10: alone 5 per ms; two at once 5 per ms each (b = 0: linear).
    work = RunningWork(BatchingCurve.of(2, 10.0, 5.0))
    work.start("long", 100.0, 0.0)
    work.start("short", 20.0, 0.0)
    assert ends(work, 0.0) == [(4.0, "short"), (20.0, "long")]
    # With G = 1 instead (each of two at 5, alone at 10): short ends at 20 / 5 = 4 ms, then
    # long has 80 left at 10 per ms: 8 ms more.
    shared = RunningWork(BatchingCurve.of(2, 10.0, 10.0))
    shared.start("long", 100.0, 0.0)
    shared.start("short", 20.0, 0.0)
    assert ends(shared, 0.0) == [(4.0, "short"), (12.0, "long")]
    shared.finish("short", 4.0, 20.0)
    assert shared.next_departure_ms(4.0) == pytest.approx(8.0)
    # A request that ends later than forecast is overdue: its next end is "now".
    assert shared.next_departure_ms(30.0) == 0.0


def tenants() -> list[TenantConfig]:
    return [
        TenantConfig("chat", 1.0, 10**9, 10**9, "interactive"),
        TenantConfig("ide", 1.0, 10**9, 10**9, "interactive"),
        TenantConfig("rag", 1.0, 10**9, 10**9, "batch"),
    ]


def scheduler(**policy: object) -> TokenfairScheduler:
    return TokenfairScheduler(build_config(PolicyConfig(**policy), tenants()))  # type: ignore[arg-type]


def run(fair: TokenfairScheduler, request_id: str, tenant: str, now_ms: float) -> None:
    lane: PriorityClass = "batch" if tenant == "rag" else "interactive"
    assert fair.submit(Request(request_id, tenant, now_ms, 2000, 500, lane), now_ms) is None
    decision = fair.next_dispatch(now_ms)
    assert decision is not None
    assert decision.request_id == request_id


def test_a_free_slot_means_no_wait_however_much_runs() -> None:
    # Three heavy batch requests run (4,000 service tokens each: 266 ms of a serial engine at
    # 45 per ms). A new interactive request finds 5 of 8 slots free and nobody of its lane
    # ahead: it waits 0. The serial model queued it behind all the running work.
    batching = scheduler(max_batch_requests=8, batch_throughput_gain=4.0)
    serial = scheduler()
    for fair in (batching, serial):
        for i in range(3):
            run(fair, f"r{i}", "rag", 0.0)
    assert batching.predicted_wait_ms("chat", 0, 600, 1.0) == 0.0
    assert serial.predicted_wait_ms("chat", 0, 600, 1.0) == pytest.approx(3 * 4000 / 45 - 1.0)


def test_with_every_slot_busy_a_request_waits_for_the_first_forecast_end() -> None:
    # S = 2, G = 1 at R = 45: two requests of 4,000 tokens share 45 per ms; both end at
    # 8,000 / 45 ms: the engine takes a request sent now then. Nothing of the interactive lane
    # is queued, so a new request waits that long (more only by the lane's recent lifts, which
    # the prediction divides in: both requests joined ahead).
    fair = scheduler(max_batch_requests=2)
    run(fair, "a", "chat", 0.0)
    run(fair, "b", "ide", 0.0)
    assert fair._engine_wait_ms(0.0) == pytest.approx(8000 / 45)
    assert fair.predicted_wait_ms("chat", 0, 600, 0.0) >= 8000 / 45
    # One ends (early: at 10 ms): a slot is free, the wait is 0 again.
    fair.complete("a", 10.0, 100)
    assert fair.predicted_wait_ms("chat", 0, 600, 10.0) == 0.0
    fair.complete("b", 20.0)
    assert fair.books() == Books(0, 0, 0, 0, 0)


def test_the_gates_count_the_decode_growth_of_the_running_requests() -> None:
    # 460 blocks of 16 tokens, interactive watermark 0.9 (414). Two requests book 157 blocks
    # each (2000 prompt tokens: 125 blocks, and 500 of max_tokens: 32 more).
    fair = scheduler(total_kv_blocks=460, kv_block_tokens=16, max_batch_requests=8)
    run(fair, "a", "chat", 0.0)
    run(fair, "b", "ide", 0.0)
    assert fair.resident_blocks == 314
    assert fair.submit(Request("c", "chat", 1.0, 2000, 500, "interactive"), 1.0) is None
    # The engine has started both and holds their prompts, as the model says (250): its truth
    # is 250 now, but both will grow by 32 blocks as they decode: the gates see 314, and c
    # (157 more: 471 once all three have decoded, past the engine's 460) waits.
    fair.observe_engine_kv(250, 250)
    assert fair.kv_correction_blocks == 0
    assert fair.kv_gate_blocks == 314
    assert fair.next_dispatch(1.0) is None
    # The engine holds 40 blocks more than modelled (a prompt estimated short, or another
    # client): the gates see them too.
    fair.observe_engine_kv(290, 250)
    assert fair.kv_gate_blocks == 354
    fair.observe_engine_kv(None)  # stale: the books alone
    assert (fair.kv_correction_blocks, fair.kv_gate_blocks) == (0, 314)


def test_a_request_the_engine_has_room_for_dispatches_though_the_books_are_full() -> None:
    # 400 blocks, interactive watermark 0.9 (360). Two requests book 157 each (314); a third
    # would bring the books to 471 and waits. The engine holds 120 blocks where the model says
    # 250 (a shared prefix: the engine holds it once): 130 blocks the books hold do not exist,
    # so the gates see 184 (the engine's 120 and both requests' 32 blocks of growth) and the
    # third starts.
    fair = scheduler(total_kv_blocks=400, kv_block_tokens=16, max_batch_requests=8)
    run(fair, "a", "chat", 0.0)
    run(fair, "b", "ide", 0.0)
    assert fair.submit(Request("c", "chat", 1.0, 2000, 500, "interactive"), 1.0) is None
    assert fair.next_dispatch(1.0) is None
    fair.observe_engine_kv(120, 250)
    assert fair.kv_gate_blocks == 184
    decision = fair.next_dispatch(1.0)
    assert decision is not None
    assert decision.request_id == "c"
    assert decision.kv_occupancy_ratio == round((184 + 157) / 400, 4)
    # The credit may have been a's alone: when a ends, it goes with a, up to a's reservation
    # (-130 + 157 > 0: none is left), so the gates see the books of b and c until the next
    # report, never less.
    fair.complete("a", 5.0)
    assert (fair.kv_correction_blocks, fair.kv_gate_blocks) == (0, 314)
    # A larger credit is given back by a request's reservation at a time.
    fair.observe_engine_kv(0, 250)
    assert fair.kv_correction_blocks == -250
    fair.complete("b", 6.0)
    assert (fair.kv_correction_blocks, fair.kv_gate_blocks) == (-93, 64)
    fair.complete("c", 7.0)
    assert (fair.kv_correction_blocks, fair.kv_gate_blocks) == (0, 0)
    assert fair.books() == Books(0, 0, 0, 0, 0)


def test_what_the_engine_holds_beyond_the_books_stays_until_its_next_report() -> None:
    # Another client of the engine holds 100 blocks: a request of ours ending does not make
    # them free; the next report says what is left.
    fair = scheduler(total_kv_blocks=1000, kv_block_tokens=16, max_batch_requests=8)
    run(fair, "a", "chat", 0.0)
    fair.observe_engine_kv(225, 125)
    assert fair.kv_gate_blocks == 157 + 100
    fair.complete("a", 1.0)
    assert (fair.resident_blocks, fair.kv_gate_blocks) == (0, 100)
    fair.observe_engine_kv(0, 0)
    assert fair.kv_gate_blocks == 0


def test_with_a_decode_allowance_a_request_dispatched_is_booked_at_its_prompt_and_it() -> None:
    # kvDecodeBooking: engine, on the core alone. 440 blocks of 16, watermark 0.9 (396). Two
    # requests book 157 each (125 prompt blocks, 32 of max_tokens). The engine's report: 250
    # held, and the view credits each its reservation beyond its prompt and an allowance of
    # 16 tokens (one block): 31 blocks each. The gates see 250 + 2 x 1 = 252, and a third
    # request, booked at 125 + 1 blocks (not 157), starts.
    fair = scheduler(total_kv_blocks=440, kv_block_tokens=16, max_batch_requests=8)
    run(fair, "a", "chat", 0.0)
    run(fair, "b", "ide", 0.0)
    assert fair.submit(Request("c", "chat", 1.0, 2000, 500, "interactive"), 1.0) is None
    assert fair.next_dispatch(1.0) is None  # 314 + 157 > 396
    job = fair.jobs["c"]
    assert fair.kv_gate_job_blocks(job) == job.kv_blocks == 157  # no allowance: in full
    fair.observe_engine_kv(250, 250, 16, {"a": 31, "b": 31})
    assert (fair.kv_decode_allowance_tokens, fair.kv_gate_blocks) == (16, 252)
    assert fair.kv_gate_job_blocks(job) == 126
    decision = fair.next_dispatch(1.0)
    assert decision is not None
    assert decision.request_id == "c"
    assert decision.kv_occupancy_ratio == round((252 + 126) / 440, 4)
    assert (fair.resident_blocks, fair.kv_gate_blocks) == (471, 378)  # the books: in full
    assert (fair.kv_correction_blocks, fair.kv_gate_credit_blocks) == (0, 31 + 31 + 31)
    # a ends before the next report: its own credit (31) goes with it, no more: the gates see
    # b and c at their prompt and allowance (126 each) until the next report.
    fair.complete("a", 5.0)
    assert (fair.kv_correction_blocks, fair.kv_gate_blocks) == (0, 252)
    # Stale: every reservation in full again, at once.
    fair.observe_engine_kv(None)
    assert (fair.kv_decode_allowance_tokens, fair.kv_gate_blocks) == (-1, 314)
    assert fair.kv_gate_job_blocks(job) == 157
    fair.complete("b", 6.0)
    fair.complete("c", 7.0)
    assert fair.books() == Books(0, 0, 0, 0, 0)


def test_with_a_decode_allowance_blocks_another_client_holds_stay_counted() -> None:
    # The engine holds 300 blocks for another client, nothing of ours runs: a positive
    # correction. Four requests (157 blocks booked, 126 by the gates with an allowance of 16
    # tokens) each start and end before the next report: each takes its own credit (31
    # blocks) back, and the gates still see the 300 blocks (the old credit, taken off the
    # correction and given back only while it was negative, erased them: 300, 207, ..., 0).
    fair = scheduler(total_kv_blocks=1000, kv_block_tokens=16, max_batch_requests=8)
    fair.observe_engine_kv(300, 0, 16, {})
    assert fair.kv_gate_blocks == 300
    for n in range(4):
        run(fair, f"r{n}", "chat", float(n))
        assert fair.kv_gate_blocks == 300 + 126
        fair.complete(f"r{n}", n + 0.5)
        assert (fair.kv_correction_blocks, fair.kv_gate_blocks) == (300, 300)
    assert fair.books() == Books(0, 0, 0, 0, 0)


def test_the_lesson_policies_book_up_front_whatever_the_allowance() -> None:
    # kvDecodeBooking is the sidecar's, but the lesson's policies keep their decisions: a
    # report with an allowance and credits sets neither (docs/capacity.md).
    policy = PolicyConfig(total_kv_blocks=1000, kv_block_tokens=16, max_batch_requests=8)
    config = build_config(policy, tenants())
    for name in ("request_count_no_admission", "service_token_drr_with_admission"):
        lesson = make_scheduler(name, config)
        assert lesson.submit(Request("a", "chat", 0.0, 2000, 500, "interactive"), 0.0) is None
        assert lesson.next_dispatch(0.0) is not None
        lesson.observe_engine_kv(125, 125, 16, {"a": 31})
        assert (lesson.kv_decode_allowance_tokens, lesson.kv_gate_credit_blocks) == (-1, 0), name
        assert lesson.kv_gate_blocks == 157, name
        assert lesson.submit(Request("b", "ide", 1.0, 2000, 500, "interactive"), 1.0) is None
        decision = lesson.next_dispatch(1.0)
        assert decision is not None
        assert decision.kv_occupancy_ratio == round((157 + 157) / 1000, 4), name
        assert lesson.kv_gate_blocks == 314, name
