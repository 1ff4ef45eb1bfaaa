"""The simulator's replay of a batching engine (``maxBatchRequests`` S > 1).

Behaviours under test (hand-worked processor sharing; ``R`` the throughput at the full batch,
``G`` the gain, ``r1 = R / G`` one request's speed alone, ``v(c) = 1 / (a + b c)``):

* two equal requests of ``s`` service tokens dispatched together on S = 2 end together: at
  ``2 s / R`` when G = 1 (the batch shares one throughput), at ``s / r1`` when G = S (each runs
  as if alone); a third waits for a slot and starts when they end, alone;
* unequal requests: the short one ends first, then the long one speeds up to ``v(1)`` for its
  rest (the fluid re-forecasts on every end);
* a request ends after its *actual* service tokens when the trace records them, and is settled
  with them;
* the first token comes after the prefill stretched by ``v(1) / v(c)`` at the dispatch (the
  same for every request dispatched at one instant);
* a batching engine frees a request's KV when it ends (not ``kvResidencyFactor`` later): a
  request held back for KV starts at that end;
* given the engine's facts (``EngineFacts``, a live run's records): the first token comes after
  the prefill of the prompt as the engine counted it; a request sent that the engine's own KV
  cannot hold waits in the engine's queue (first come first served) until an end frees its
  room, and its first token is counted from its start there; with the engine's KV reported,
  the gates see what the engine holds beyond the books (a request held back at the dispatch
  gate instead); without facts, or with facts that never bind, the replay is as before;
* ``S = 1`` replays as before (the serial server; ``replay_timed`` ends it ``execution_ms``
  after its dispatch);
* property: with S > 1 every admitted request starts within its class's wait limit, every
  request gets exactly one decision, no more than S run at once, and the books are zero at
  the end;
* ``tokenfair simulate --set maxBatchRequests=...`` replays a trace file the same way.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from repo_paths import REPO_ROOT

from tokenfair.config import Config, PolicyConfig, PriorityClass, TenantConfig, build_config
from tokenfair.core import POLICIES, Books, Decision, Lane, Request, make_scheduler
from tokenfair.core.batching import BatchingCurve
from tokenfair.core.cost import CostModel
from tokenfair.sim.simulator import (
    GATE_PROMPT_RATIO_BOUNDS,
    Arrival,
    EngineFacts,
    replay_timed,
    simulate,
)

TOKENFAIR = str(Path(sys.executable).parent / "tokenfair")
RATE = 10.0  # R, service tokens per ms
PATIENT = PolicyConfig(
    service_tokens_per_ms=RATE,
    decode_weight=1.0,
    max_interactive_wait_ms=1e6,
    max_batch_wait_ms=1e6,
)


def config(batch: int, gain: float, **policy: Any) -> Config:
    tenants = [
        TenantConfig("a", 1.0, 10**9, 1e9, "interactive"),
        TenantConfig("b", 1.0, 10**9, 1e9, "batch"),
    ]
    return build_config(
        replace(PATIENT, max_batch_requests=batch, batch_throughput_gain=gain, **policy),
        tenants,
    )


def request(n: int, prefill: int, decode: int, arrival_ms: float = 0.0) -> Request:
    return Request(f"r{n}", "a", arrival_ms, prefill, decode, "interactive")


def timed(
    cfg: Config,
    arrivals: list[Arrival],
    policy: str = "tokenfair",
    engine: EngineFacts | None = None,
) -> dict[str, tuple[Decision, float | None]]:
    return {
        d.request_id: (d, end) for d, _, end in replay_timed(cfg, arrivals, policy, engine=engine)
    }


def plain(*requests: Request) -> list[Arrival]:
    return [(r, None, None) for r in requests]


# 500 prompt + 500 output at decodeWeight 1: s = 1000 service tokens each.
EQUAL = plain(request(0, 500, 500), request(1, 500, 500), request(2, 500, 500))
PREFILL_MS = 500 / PolicyConfig().prefill_tokens_per_ms  # 10.4167 ms alone


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_two_equal_requests_at_gain_1_share_one_throughput(policy: str) -> None:
    out = timed(config(2, 1.0), EQUAL, policy)
    # Two at R / 2 each: both end at 2 s / R = 200 ms; the third waits for a slot, then runs
    # alone at v(1) = R: 100 ms more.
    assert [out[f"r{i}"][1] for i in range(3)] == [pytest.approx(200.0)] * 2 + [
        pytest.approx(300.0)
    ]
    assert [out[f"r{i}"][0].dispatch_ms for i in range(3)] == [0.0, 0.0, pytest.approx(200.0)]
    assert out["r2"][0].queue_wait_ms == 200.0
    # The prefill runs at v(1) / v(2) = 2 times its time alone for the pair, 1 for the third.
    assert out["r0"][0].ttft_ms == out["r1"][0].ttft_ms == round(2 * PREFILL_MS, 2)
    assert out["r2"][0].ttft_ms == round(200.0 + PREFILL_MS, 2)


def test_two_equal_requests_at_gain_s_each_run_as_if_alone() -> None:
    out = timed(config(2, 2.0), EQUAL)
    # r1 = R / G = 5 tokens/ms whatever runs beside: s / r1 = 200 ms each, the third 200 more.
    assert [out[f"r{i}"][1] for i in range(3)] == [
        pytest.approx(200.0),
        pytest.approx(200.0),
        pytest.approx(400.0),
    ]
    assert out["r0"][0].ttft_ms == round(PREFILL_MS, 2)  # no slowdown at G = S
    assert out["r2"][0].dispatch_ms == pytest.approx(200.0)


def test_a_short_request_ends_first_and_the_long_one_speeds_up() -> None:
    # S = 2, G = 1, R = 10: 1000 and 500 service tokens from t = 0, each at 5/ms; the short one
    # ends at 100 ms (500 done of the long one), the long one then runs alone at 10/ms: its
    # other 500 take 50 ms more.
    out = timed(config(2, 1.0), plain(request(0, 500, 500), request(1, 250, 250)))
    assert out["r1"][1] == pytest.approx(100.0)
    assert out["r0"][1] == pytest.approx(150.0)
    # The same with a gain between: S = 2, G = 1.5 (r1 = 6.667, v(2) = 5): ends at 100, then
    # 500 tokens at r1: 75 ms.
    out = timed(config(2, 1.5), plain(request(0, 500, 500), request(1, 250, 250)))
    assert out["r1"][1] == pytest.approx(100.0)
    assert out["r0"][1] == pytest.approx(175.0)


def test_a_request_ends_after_its_actual_usage_and_is_settled_with_it() -> None:
    # Estimated 1000 tokens each; r0 really used 300, r1 1500. S = 2, G = 1: both at 5/ms;
    # r0 ends at 60 ms (r1 has 300), r1 runs its other 1200 alone at 10/ms: 180 ms.
    arrivals: list[Arrival] = [
        (request(0, 500, 500), 300, None),
        (request(1, 500, 500), 1500, None),
    ]
    out = timed(config(2, 1.0), arrivals)
    assert out["r0"][1] == pytest.approx(60.0)
    assert out["r1"][1] == pytest.approx(180.0)
    assert out["r0"][0].actual_service_tokens == 300
    assert out["r1"][0].actual_service_tokens == 1500


def test_kv_is_freed_when_a_request_ends() -> None:
    # 100 blocks of 16 tokens; each request holds ceil(1000 / 16) = 63 blocks, so a second one
    # does not fit beside the first (126 > 0.9 * 100) and waits for its KV. It starts when the
    # first ends (100 ms alone at R), not kvResidencyFactor (5.5) times later as the serial
    # model holds it.
    cfg = config(4, 1.0, total_kv_blocks=100, kv_block_tokens=16)
    out = timed(cfg, plain(request(0, 500, 500), request(1, 500, 500, 1.0)))
    assert out["r0"][1] == pytest.approx(100.0)
    assert out["r1"][0].dispatch_ms == pytest.approx(100.0)
    assert out["r1"][1] == pytest.approx(200.0)
    serial = timed(replace(cfg, policy=replace(cfg.policy, max_batch_requests=1)), plain(
        request(0, 500, 500), request(1, 500, 500, 1.0)))  # fmt: skip
    assert serial["r1"][0].dispatch_ms == pytest.approx(550.0)  # 5.5 x 100 ms


# Two requests estimated at 16 + 16 tokens (2 blocks of 16 each booked) that really ran a
# prompt of 96 and 100 service tokens, holding 8 blocks each on an engine of 10 blocks; S = 2,
# G = 2: each at r1 = R / 2 = 5 service tokens/ms alone or not (20 ms each). Prefill at 8
# tokens/ms: 12 ms for the engine's 96 prompt tokens.
ENGINE_CFG = config(2, 2.0, total_kv_blocks=10, kv_block_tokens=16, prefill_tokens_per_ms=8.0)
TWICE: list[Arrival] = [(request(0, 16, 16), 100, 8), (request(1, 16, 16, 1.0), 100, 8)]
PROMPTS = {"r0": 96, "r1": 96}


def test_the_first_token_comes_after_the_engines_prompts_first_come_first_served() -> None:
    plain_out = timed(ENGINE_CFG, TWICE)
    # Without facts both run at once (the books: 4 of 10 blocks), the prefill of the
    # estimate's 16 tokens at 8/ms is under the 8 ms floor.
    assert [plain_out[r][0].dispatch_ms for r in ("r0", "r1")] == [0.0, 1.0]
    assert [plain_out[r][1] for r in ("r0", "r1")] == [pytest.approx(20.0), pytest.approx(21.0)]
    assert plain_out["r1"][0].ttft_ms == 8.0
    # The engine's prompts, 96 tokens at 8/ms, prefilled in the order started: r0's first token
    # at 12 ms, r1's (sent at 1 ms) once r0's prompt and its own are done, at 24 ms.
    out = timed(ENGINE_CFG, TWICE, engine=EngineFacts(PROMPTS, None, None))
    assert [out[r][1] for r in ("r0", "r1")] == [pytest.approx(20.0), pytest.approx(21.0)]
    assert out["r0"][0].ttft_ms == 12.0
    assert out["r1"][0].ttft_ms == 23.0
    # The engine's prefill throughput, when the facts give it, rather than the policy's.
    fast = timed(ENGINE_CFG, TWICE, engine=EngineFacts(PROMPTS, None, None, 16.0))
    assert [fast[r][0].ttft_ms for r in ("r0", "r1")] == [8.0, 11.0]  # 6 (the floor: 8), 12 - 1


def test_each_prompt_costs_the_engines_prefill_queue_its_overhead_too() -> None:
    # The engine's prefill at 16 prompt tokens/ms and 4 ms a prompt (its step): r0's 96
    # tokens are done at 4 + 6 = 10 ms (above the 8 ms floor); r1, sent at 1 ms, waits for
    # them and then pays its own 4 + 6: done at 20 ms, 19 ms after its start. Without the
    # overhead the same queue gives 8 (the floor) and 11 ms.
    out = timed(ENGINE_CFG, TWICE, engine=EngineFacts(PROMPTS, None, None, 16.0, "learned", 4.0))
    assert [out[r][0].ttft_ms for r in ("r0", "r1")] == [10.0, 19.0]
    # The ends are the fluid's: the overhead is the first token's alone.
    assert [out[r][1] for r in ("r0", "r1")] == [pytest.approx(20.0), pytest.approx(21.0)]
    # An integer overhead is the same number; 0 is the queue of the tokens alone.
    assert timed(ENGINE_CFG, TWICE, engine=EngineFacts(
        PROMPTS, None, None, 16, prefill_overhead_ms=4))["r1"][0].ttft_ms == 19.0  # fmt: skip
    assert timed(ENGINE_CFG, TWICE, engine=EngineFacts(
        PROMPTS, None, None, 16.0, prefill_overhead_ms=0))["r1"][0].ttft_ms == 11.0  # fmt: skip


def test_a_request_the_engines_kv_cannot_hold_waits_in_the_engine() -> None:
    out = timed(ENGINE_CFG, TWICE, engine=EngineFacts(PROMPTS, 10, None))
    # The sidecar sent r1 at 1 ms (its books had room); the engine held it until r0 ended at
    # 20 ms, then ran it alone: 20 ms more. Its first token: 19 ms in the engine's queue + 12.
    assert out["r1"][0].dispatch_ms == 1.0
    assert out["r1"][0].queue_wait_ms == 0.0
    assert out["r0"][1] == pytest.approx(20.0)
    assert out["r1"][1] == pytest.approx(40.0)
    assert out["r1"][0].ttft_ms == 19.0 + 12.0
    # An engine large enough never holds one back: as without the limit.
    roomy = timed(ENGINE_CFG, TWICE, engine=EngineFacts(PROMPTS, 16, None))
    assert roomy["r1"][1] == pytest.approx(21.0)
    assert roomy["r1"][0].ttft_ms == 23.0


def test_the_gates_see_the_engines_kv_when_it_is_reported() -> None:
    # Reported at every event: r0 holds 8 blocks of the engine where the books booked 2, so
    # the gate sees 2 + (8 - 2) = 8 blocks, and r1 (2 more, 10 > 0.9 x 10) is held back at the
    # dispatch gate until r0 ends: the sidecar's queue, not the engine's.
    out = timed(ENGINE_CFG, TWICE, engine=EngineFacts(PROMPTS, 10, 0.0))
    assert out["r1"][0].dispatch_ms == pytest.approx(20.0)
    assert out["r1"][0].queue_wait_ms == pytest.approx(19.0)
    assert out["r1"][1] == pytest.approx(40.0)
    assert out["r1"][0].ttft_ms == pytest.approx(19.0 + 12.0)
    # Reported every 50 ms (the sidecar's poll): r1 arrives before the first report after r0
    # started, the gate sees the books alone, and the engine's own queue holds it instead.
    polled = timed(ENGINE_CFG, TWICE, engine=EngineFacts(PROMPTS, 10, 50.0))
    assert polled["r1"][0].dispatch_ms == 1.0
    assert polled["r1"][1] == pytest.approx(40.0)


def test_the_engines_report_corrects_the_gates_against_what_was_booked() -> None:
    # Each request holds 4 engine blocks (48 + 16 tokens), and a scheduler booking prompts at
    # 3x the estimate books 4 for each (ceil(3 x 16 + 16) / 16): the books are right, so the
    # report corrects nothing. r1's gate: 4 booked + (4 - 4) + 4 = 8 <= 0.9 x 10, dispatched at
    # once. Recomputing r0's booking at the estimate (2) would count the ratio's 2 extra blocks
    # again (4 + 2 + 4 = 10 > 9), holding r1 back until r0 ends at 20 ms.
    held_4 = [(request(0, 16, 16), 100, 4), (request(1, 16, 16, 1.0), 100, 4)]
    facts = EngineFacts({"r0": 48, "r1": 48}, 10, 0.0, kv_prompt_ratio="off")
    scheduler = make_scheduler("tokenfair", ENGINE_CFG)
    scheduler.kv_prompt_ratio = 3.0
    out = {d.request_id: d for d, _, _ in replay_timed(
        ENGINE_CFG, held_4, "tokenfair", scheduler=scheduler, engine=facts)}  # fmt: skip
    assert out["r1"].dispatch_ms == 1.0
    assert out["r1"].kv_occupancy_ratio == pytest.approx(0.8)  # 4 + 4 booked of 10


def test_the_replay_books_at_the_prompt_ratio_the_sidecar_learns() -> None:
    # r0 ends at 20 ms; its engine prompt, 48 tokens against the estimate's 16, teaches the
    # sidecar a ratio of 3 (kvPromptRatio: learned, its default): r2, admitted at 30 ms, books
    # ceil((48 + 16) / 16) = 4 blocks, where the estimate books 2. r1 was admitted before any
    # request ended: at the estimate.
    arrivals: list[Arrival] = [
        (request(0, 16, 16), 100, 4),
        (request(1, 16, 16, 1.0), 100, 4),
        (request(2, 16, 16, 30.0), 100, 4),
    ]
    prompts = {"r0": 48, "r1": 48, "r2": 48}

    def run(mode: str) -> tuple[dict[str, Decision], float]:
        scheduler = make_scheduler("tokenfair", ENGINE_CFG)
        facts = EngineFacts(prompts, None, None, kv_prompt_ratio=mode)
        out = {d.request_id: d for d, _, _ in replay_timed(
            ENGINE_CFG, arrivals, "tokenfair", scheduler=scheduler, engine=facts)}  # fmt: skip
        return out, scheduler.kv_prompt_ratio

    learned, ratio = run("learned")
    assert ratio == pytest.approx(3.0)
    assert learned["r1"].kv_occupancy_ratio == pytest.approx(0.4)  # r0's 2 + its own 2
    # r2's dispatch: r1 (2 blocks, running until 21 ms) ended, r2 alone with its 4.
    assert learned["r2"].kv_occupancy_ratio == pytest.approx(0.4)
    off, ratio_off = run("off")
    assert ratio_off == 1.0
    assert off["r2"].kv_occupancy_ratio == pytest.approx(0.2)
    # A prompt 6x the estimate is learned at 6 and booked at the gates' bound, 4.
    prompts.update(r0=96, r1=96, r2=96)
    assert run("learned")[1] == GATE_PROMPT_RATIO_BOUNDS[1] == 4.0


def test_the_replays_ratio_learner_is_the_sidecars() -> None:
    # The compiled simulator cannot import the server's constants: its copies must agree.
    from tokenfair.server import kv_view
    from tokenfair.server.runtime_settings import KV_PROMPT_RATIO_MODES as SIDECAR_MODES
    from tokenfair.sim import simulator

    assert simulator.PROMPT_RATIO_BOUNDS == kv_view.PROMPT_RATIO_BOUNDS
    assert simulator.PROMPT_RATIO_DECAY == kv_view.PROMPT_RATIO_DECAY
    assert simulator.GATE_PROMPT_RATIO_BOUNDS == kv_view.GATE_PROMPT_RATIO_BOUNDS
    assert set(simulator.KV_PROMPT_RATIO_MODES) == set(SIDECAR_MODES)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (({"r0": 96.0}, None, None), {}, r"prompt_tokens\['r0'\]: must be an integer"),
        (({"r0": True}, None, None), {}, r"prompt_tokens\['r0'\]: must be an integer"),
        (({"r0": -1}, None, None), {}, r"prompt_tokens\['r0'\]: must be at least 0"),
        (({1: 96}, None, None), {}, r"prompt_tokens: keys must be request ids"),
        ((PROMPTS, 10.5, None), {}, r"kv_blocks: must be an integer"),
        ((PROMPTS, 0, None), {}, r"kv_blocks: must be at least 1"),
        ((PROMPTS, -5, None), {}, r"kv_blocks: must be at least 1"),
        ((PROMPTS, 10, math.nan), {}, r"report_interval_ms: must be finite and at least 0"),
        ((PROMPTS, 10, -1.0), {}, r"report_interval_ms: must be finite and at least 0"),
        ((PROMPTS, 10, "250"), {}, r"report_interval_ms: must be a number"),
        ((PROMPTS, None, None, 0.0), {}, r"prefill_tokens_per_ms: must be finite and above 0"),
        ((PROMPTS, None, None, -8.0), {}, r"prefill_tokens_per_ms: must be finite and above 0"),
        ((PROMPTS, None, None, math.nan), {}, r"prefill_tokens_per_ms: must be finite and above"),
        ((PROMPTS, None, None, math.inf), {}, r"prefill_tokens_per_ms: must be finite and above"),
        ((PROMPTS, None, None), {"kv_prompt_ratio": "on"}, r"kv_prompt_ratio: must be one of"),
        ((PROMPTS, None, None), {"prefill_overhead_ms": -1.0}, r"prefill_overhead_ms: must be fin"),
        ((PROMPTS, None, None), {"prefill_overhead_ms": math.inf}, r"prefill_overhead_ms: must"),
        ((PROMPTS, None, None), {"prefill_overhead_ms": None}, r"prefill_overhead_ms: must be a n"),
        ((PROMPTS, None, None), {"prefill_overhead_ms": True}, r"prefill_overhead_ms: must be a n"),
    ],
)
def test_engine_facts_refuse_what_the_replay_cannot_run(
    args: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=r"EngineFacts\." + message):
        EngineFacts(*args, **kwargs)


def test_engine_facts_take_integers_where_floats_are_meant() -> None:
    # An integer prefill speed or report interval is a number like any other (the compiled
    # core's float fields store it as one): the same replay as with floats.
    ints = timed(ENGINE_CFG, TWICE, engine=EngineFacts(PROMPTS, 10, 0, 16))
    floats = timed(ENGINE_CFG, TWICE, engine=EngineFacts(PROMPTS, 10, 0.0, 16.0))
    assert [ints[r][0].ttft_ms for r in ("r0", "r1")] == [
        floats[r][0].ttft_ms for r in ("r0", "r1")
    ]


def test_a_serial_server_replays_as_before() -> None:
    cfg = config(1, 1.0)
    out = timed(cfg, EQUAL)
    assert [out[f"r{i}"][1] for i in range(3)] == [100.0, 200.0, 300.0]
    assert [d.dispatch_ms for d in simulate(cfg, [a[0] for a in EQUAL], "tokenfair")] == [
        0.0,
        100.0,
        200.0,
    ]


# -- property ------------------------------------------------------------------------------

CLASSES: tuple[PriorityClass, ...] = ("interactive", "interactive", "batch", "batch")


@st.composite
def batching_configs(draw: st.DrawFn) -> Config:
    batch = draw(st.integers(2, 8))
    gain = draw(st.sampled_from([1.0, 1.5, float(batch) / 2, float(batch)]))
    tenants = [
        TenantConfig(
            f"t{i}",
            draw(st.sampled_from([0.5, 1.0, 2.0])),
            draw(st.integers(2_000, 60_000)),
            float(draw(st.integers(1_000, 200_000))),
            priority_class,
        )
        for i, priority_class in enumerate(CLASSES)
    ]
    policy = PolicyConfig(
        max_batch_requests=batch,
        batch_throughput_gain=max(1.0, gain),
        lend_idle_capacity=draw(st.booleans()),
    )
    return build_config(policy, tenants)


@st.composite
def batching_traces(draw: st.DrawFn) -> list[Arrival]:
    count = draw(st.integers(1, 60))
    arrival_ms = 0.0
    arrivals: list[Arrival] = []
    for i in range(count):
        arrival_ms += draw(st.sampled_from([0.0, 0.5, 3.0, 20.0, 80.0, 400.0]))
        tenant = draw(st.integers(0, len(CLASSES) - 1))
        prefill, decode = draw(st.integers(0, 4_000)), draw(st.integers(0, 600))
        used = draw(st.one_of(st.none(), st.integers(0, 20_000)))
        request = Request(f"r{i:03d}", f"t{tenant}", arrival_ms, prefill, decode, CLASSES[tenant])
        arrivals.append((request, used, None))
    return arrivals


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=60, deadline=None)
@given(cfg=batching_configs(), arrivals=batching_traces())
def test_batching_replay_keeps_wait_limits_slots_and_books(
    policy: str, cfg: Config, arrivals: list[Arrival]
) -> None:
    scheduler = make_scheduler(policy, cfg)
    out = list(replay_timed(cfg, arrivals, policy, scheduler))
    ids = [d.request_id for d, _, _ in out]
    assert sorted(ids) == sorted(a[0].request_id for a in arrivals)  # one decision each
    assert scheduler.books() == Books(0, 0, 0, 0, 0)
    admitted = [(d, end) for d, _, end in out if d.admitted]
    # Never more than S at once: sweep the [dispatch, end) intervals.
    events = sorted(
        [(end, -1) for d, end in admitted if end is not None]
        + [(d.dispatch_ms, 1) for d, _ in admitted if d.dispatch_ms is not None]
    )
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert peak <= cfg.policy.max_batch_requests
    for decision, end in admitted:
        assert decision.dispatch_ms is not None
        assert end is not None
        assert end >= decision.dispatch_ms
        if policy == "tokenfair":
            limit_ms = scheduler.wait_limit_ms(Lane.of(decision.priority_class))
            assert decision.queue_wait_ms <= limit_ms


def test_every_service_ends_at_the_speed_of_the_curve() -> None:
    # A lone request of s tokens takes s / r1 with r1 = R / G: 2000 tokens at S = 8, G = 4,
    # R = 10 -> r1 = 2.5, 800 ms.
    out = timed(config(8, 4.0), plain(request(0, 1000, 1000)))
    assert out["r0"][1] == pytest.approx(
        2000 / BatchingCurve.of(8, RATE, RATE / 4).request_speed(1)
    )
    assert out["r0"][1] == pytest.approx(800.0)
    assert CostModel.from_policy(config(8, 4.0).policy).max_batch_requests == 8


def test_simulate_command_replays_a_batching_engine(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    subprocess.run(
        [TOKENFAIR, "trace", "generate", "--duration-ms", "20000", "--seed", "3",
         "--out", str(trace)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    tenants = Path(__file__).parents[3] / "examples" / "sidecar-standalone.yaml"
    reports = {}
    for batch in ("1", "8"):
        done = subprocess.run(
            [TOKENFAIR, "simulate", "--trace", str(trace), "--tenants", str(tenants),
             "--policy", "tokenfair", "--format", "json", "--no-progress",
             "--set", f"maxBatchRequests={batch}", "--set", "batchThroughputGain=4"
             if batch == "8" else "batchThroughputGain=1"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        reports[batch] = json.loads(done.stdout)["comparison"]["tokenfair"]
    assert reports["1"]["total_requests"] == reports["8"]["total_requests"] > 100
    # Not the same replay: eight requests share the engine, each slower than alone.
    assert reports["1"]["interactive_p50_ttft_ms"] != reports["8"]["interactive_p50_ttft_ms"]


@pytest.mark.parametrize("speed", ["0", "-8", "nan", "inf", "fast"])
def test_the_engine_model_bench_refuses_a_prefill_speed_it_cannot_replay(
    speed: str, tmp_path: Path
) -> None:
    # Refused by the argument parser (exit 2, the flag named), before any file is read: not
    # a ZeroDivisionError deep in the replay, nor every first token at the floor.
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "bench_engine_model.py"),
         "--records", str(tmp_path / "none.jsonl"), "--config", str(tmp_path / "none.yaml"),
         f"--engine-prefill-tokens-per-ms={speed}"],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--engine-prefill-tokens-per-ms" in done.stderr
    assert ("must be a number" if speed == "fast" else "must be finite and above 0") in done.stderr


@pytest.mark.parametrize("overhead", ["-1", "nan", "inf", "step"])
def test_the_engine_model_bench_refuses_a_prefill_overhead_it_cannot_replay(
    overhead: str, tmp_path: Path
) -> None:
    # 0 is a valid overhead (the queue of the tokens alone); below it, or not finite, the
    # parser refuses with the flag named, before any file is read.
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "bench_engine_model.py"),
         "--records", str(tmp_path / "none.jsonl"), "--config", str(tmp_path / "none.yaml"),
         f"--engine-prefill-overhead-ms={overhead}"],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--engine-prefill-overhead-ms" in done.stderr
    expected = "must be a number" if overhead == "step" else "must be finite and at least 0"
    assert expected in done.stderr
