"""The KV gates under ``kvDecodeBooking`` (the scheduler's books and gate credits, fed by the
sidecar's :class:`~tokenfair.server.kv_view.KvView`), over random sequences.

Behaviour under test, in every mode (``upfront``, ``engine``, ``peak``) and on both cores (the
suite runs on the compiled core when built; ``TOKENFAIR_NATIVE=0`` on the interpreted one):

- the gates' invariant: while a report is fresh, the gates never see fewer blocks than the
  engine's last report less what the requests that ended since held in it (another client's
  blocks, prompts under-estimated: a positive correction stays counted however many requests
  end between two reports, in whatever order), each request's end taking off the gates
  exactly what they counted for it (its reservation less its credit);
- the books' invariant: once every request has ended, the books are empty, no gate credit is
  left and the gates see the last report's correction alone;
- a request settled with its actual KV but released later keeps no credit: the gates count
  what it holds, as the books do.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from sidecar_support import PATIENT_POLICY, keyed_config

from tokenfair.core import Request, make_scheduler
from tokenfair.server.kv_view import KvView, StreamProgress

BLOCK = 16
TENANTS = ("tenant_chat_pro", "tenant_ide_assist")


def run_sequence(mode: str, seed: int) -> int:
    """One random sequence of dispatches, relays, endings, fresh and stale reports; returns
    the number of steps checked against the gates' invariant (it asserts it at each)."""
    rng = random.Random(seed)
    policy = dataclasses.replace(
        PATIENT_POLICY, kv_block_tokens=BLOCK, total_kv_blocks=100_000, max_batch_requests=64
    )
    config = keyed_config(
        policy, burst_service_tokens=10**12, sustained_service_tokens_per_second=10**9
    )
    scheduler = make_scheduler("tokenfair", config)
    now = [0.0]
    view = KvView(clock=lambda: now[0], decode_booking=mode)
    live: dict[str, StreamProgress] = {}

    def holds(request_id: str) -> int:  # what the engine holds for a running request
        job = scheduler.jobs[request_id]
        shown = min(live[request_id].events, job.request.decode_tokens)
        return -(-(job.kv_prompt_tokens + shown) // BLOCK)

    reported: int | None = None  # the engine's last fresh report (blocks in use)
    at_report: dict[str, int] = {}  # what each request held in it
    ended_since = 0  # of which, held by the requests ended since
    checked = 0
    credits = 0  # requests that ended holding a gate credit
    sent = 0
    for _ in range(400):
        now[0] += rng.uniform(0, 50)
        act = rng.random()
        if act < 0.3 and sent < 300:
            request = Request(
                f"r{sent}",
                rng.choice(TENANTS),
                now[0],
                rng.randrange(1, 3000),
                rng.randrange(1, 3000),
                "interactive",
            )
            sent += 1
            if scheduler.submit(request, now[0]) is None:
                while (decision := scheduler.next_dispatch(now[0])) is not None:
                    progress = view.track(decision.request_id, bounded_end=True)
                    assert progress is not None
                    live[decision.request_id] = progress
        elif act < 0.5 and live:
            for progress in live.values():
                progress.relayed(b"data: {}\n\n" * rng.randrange(0, 40))
        elif act < 0.65 and live:
            request_id = rng.choice(list(live))
            del live[request_id]
            gate = scheduler.kv_gate_blocks
            counted = scheduler.kv_gate_freed_blocks(scheduler.jobs[request_id])
            credits += scheduler.jobs[request_id].kv_gate_credit > 0
            scheduler.complete(request_id, now[0])
            view.forget(request_id)
            if scheduler.kv_correction_blocks >= 0:  # its credit given back, no more
                assert scheduler.kv_gate_blocks == gate - counted, (mode, seed)
            ended_since += at_report.pop(request_id, 0)
        elif act < 0.85:
            other = rng.choice((0, 0, 500, 3000))  # another client of the engine
            at_report = {request_id: holds(request_id) for request_id in live}
            reported = other + sum(at_report.values())
            ended_since = 0
            view.observe(scheduler, reported, running=len(live), waiting=0)
        elif act < 0.9:
            reported = None
            at_report = {}
            view.observe(scheduler, None)
        if reported is not None:
            checked += 1
            assert scheduler.kv_gate_blocks >= reported - ended_since, (mode, seed)
    for request_id in list(live):
        scheduler.complete(request_id, now[0])
        view.forget(request_id)
    while (decision := scheduler.next_dispatch(now[0])) is not None:
        scheduler.complete(decision.request_id, now[0])
    assert (scheduler.resident_blocks, scheduler.running) == (0, 0)
    assert scheduler.kv_gate_credit_blocks == 0
    assert scheduler.kv_gate_blocks == scheduler.kv_correction_blocks >= 0
    assert credits > 0 or mode == "upfront", (mode, seed)
    return checked


@pytest.mark.parametrize("mode", ["upfront", "engine", "peak"])
def test_the_gates_never_see_less_than_the_report_less_what_ended_since(mode: str) -> None:
    checked = sum(run_sequence(mode, seed) for seed in range(40))
    assert checked > 4000  # the invariant was checked at many fresh-report steps


def test_a_request_settled_with_its_actual_kv_has_no_credit_left() -> None:
    # A request settled with its actual KV (`actual_kv_blocks`) but released later: its
    # reservation shrinks to what it holds, and its gate credit (decode to come) goes, so the
    # gates count those blocks until the release, as the books do (they read -194).
    policy = dataclasses.replace(PATIENT_POLICY, kv_block_tokens=BLOCK, total_kv_blocks=100_000)
    config = keyed_config(
        policy, burst_service_tokens=10**12, sustained_service_tokens_per_second=10**9
    )
    scheduler = make_scheduler("tokenfair", config)
    scheduler.observe_engine_kv(0, 0, BLOCK)  # fresh, engine booking, an allowance of a block
    assert scheduler.submit(Request("a", TENANTS[0], 0.0, 160, 3200, "interactive"), 0.0) is None
    assert scheduler.next_dispatch(0.0) is not None
    job = scheduler.jobs["a"]
    assert job.kv_gate_credit == job.kv_blocks - 11 > 5  # booked at 160 + 16 tokens: 11 blocks
    scheduler.complete("a", 1.0, actual_kv_blocks=5, release_kv=False)
    assert (scheduler.resident_blocks, scheduler.kv_gate_credit_blocks) == (5, 0)
    assert scheduler.kv_gate_blocks == 5
    scheduler.release_kv("a")
    assert (scheduler.resident_blocks, scheduler.kv_gate_credit_blocks) == (0, 0)
    assert scheduler.kv_gate_blocks == 0
