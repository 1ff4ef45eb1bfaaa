"""Shadow mode in the core and the simulator (``enforcement: Shadow``, docs/sidecar.md).

Behaviours: under ``Shadow`` every gate decides as under ``Enforce`` — the same trace gives the
same decisions, request for request: each refusal of ``Enforce`` is a ``would_refuse`` record of
``Shadow`` with the same reason and gate (and the values its gate saw), served (status 200);
each admission is the same dispatch at the same time. Shadow refuses nothing. A tenant's own
``enforcement`` overrides the policy's both ways. Switching modes is a reload that drops no
queued request. The config names the field and the rule of a bad value; documents without
shadow mode render as before.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from tokenfair.config import (
    Config,
    ConfigError,
    PolicyConfig,
    TenantConfig,
    build_config,
    config_to_document,
    loads_config,
    parse_policy,
    parse_tenant,
)
from tokenfair.core import Decision, Request, make_scheduler
from tokenfair.core.jobs import STATUS_OK
from tokenfair.records.codec import decision_line, encode_record_line, line_fields, parse_decision
from tokenfair.sim.fairness import fairness_report
from tokenfair.sim.report import summarize
from tokenfair.sim.simulator import simulate

TENANTS = (
    TenantConfig("chat", 2.0, 6_000, 40_000, "interactive"),
    TenantConfig("ide", 1.0, 9_000, 90_000, "interactive"),
    TenantConfig("rag", 1.0, 30_000, 60_000, "batch"),
)


def overload_trace(seed: int, count: int = 600) -> list[Request]:
    """Random arrivals at about twice the lesson server's capacity (45 tokens/ms), with
    bursts: every gate of the tokenfair policy gets to refuse something."""
    rng = random.Random(seed)
    requests = []
    clock = 0.0
    for i in range(count):
        clock += rng.expovariate(1 / 12.0)
        tenant = rng.choice(("chat", "chat", "ide", "rag"))
        if tenant == "rag":
            requests.append(Request(f"r{i:04d}", tenant, round(clock, 3), 3200, 350, "batch"))
        else:
            prefill = rng.randint(100, 900)
            requests.append(
                Request(
                    f"r{i:04d}",
                    tenant,
                    round(clock, 3),
                    prefill,
                    rng.randint(20, 200),
                    "interactive",
                )
            )
    return requests


def config_of(policy: PolicyConfig, tenants: tuple[TenantConfig, ...] = TENANTS) -> Config:
    return build_config(policy, tenants)


POLICIES = {
    "serial": PolicyConfig(max_queued_requests_per_tenant=6, max_queued_requests=14),
    "batching": PolicyConfig(
        max_batch_requests=4, batch_throughput_gain=2.0, max_queued_requests_per_tenant=8
    ),
}


def refused(decision: Decision) -> bool:
    return decision.status_code != STATUS_OK


def same_outcome(enforced: Decision, shadowed: Decision) -> None:
    """``shadowed`` is ``enforced``'s decision: a refusal as a would_refuse record, served;
    an admission the very same dispatch."""
    assert shadowed.request_id == enforced.request_id
    if refused(enforced):
        assert shadowed.would_refuse
        assert shadowed.status_code == STATUS_OK
        assert (shadowed.reason, shadowed.gate) == (enforced.reason, enforced.gate)
        assert shadowed.observed == enforced.observed
        assert shadowed.retry_after_ms == enforced.retry_after_ms
        assert shadowed.queue_wait_ms == enforced.queue_wait_ms
    else:
        assert not shadowed.would_refuse
        assert (shadowed.reason, shadowed.gate, shadowed.dispatch_ms, shadowed.ttft_ms) == (
            enforced.reason, enforced.gate, enforced.dispatch_ms, enforced.ttft_ms
        )  # fmt: skip


@pytest.mark.parametrize("engine", sorted(POLICIES))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_shadow_decides_as_enforce_and_refuses_nothing(engine: str, seed: int) -> None:
    trace = overload_trace(seed)
    policy = POLICIES[engine]
    enforced = simulate(config_of(policy), trace, "tokenfair")
    shadowed = simulate(config_of(replace(policy, enforcement="Shadow")), trace, "tokenfair")
    refusals = [d for d in enforced if refused(d)]
    gates = {(d.reason, d.gate) for d in refusals}
    # The trace exercises several gates, admission and queue alike (else the test shows little).
    assert len(refusals) >= 20, len(refusals)
    assert len({reason for reason, _ in gates}) >= 3, gates
    assert {gate for _, gate in gates} >= {"admission", "queue"}, gates
    assert len(shadowed) == len(enforced) == len(trace)
    by_id = {d.request_id: d for d in shadowed}
    for decision in enforced:
        same_outcome(decision, by_id[decision.request_id])
    assert not [d for d in shadowed if refused(d)]  # shadow refuses nothing
    assert sum(d.would_refuse for d in shadowed) == len(refusals)


def test_a_tenants_own_enforcement_overrides_the_policys() -> None:
    trace = overload_trace(7)
    policy = POLICIES["serial"]
    enforced = simulate(config_of(policy), trace, "tokenfair")
    # Only chat in shadow:
    only_chat = tuple(replace(t, enforcement="Shadow") if t.tenant_id == "chat" else t
                      for t in TENANTS)  # fmt: skip
    one = simulate(config_of(policy, only_chat), trace, "tokenfair")
    # Everyone in shadow but chat, which enforces:
    all_but_chat = tuple(replace(t, enforcement="Enforce") if t.tenant_id == "chat" else t
                         for t in TENANTS)  # fmt: skip
    other = simulate(config_of(replace(policy, enforcement="Shadow"), all_but_chat), trace,
                     "tokenfair")  # fmt: skip
    assert any(refused(d) and d.tenant_id == "chat" for d in enforced)
    assert any(refused(d) and d.tenant_id != "chat" for d in enforced)
    for run, shadow_tenants in ((one, {"chat"}), (other, {"ide", "rag"})):
        by_id = {d.request_id: d for d in run}
        for decision in enforced:
            got = by_id[decision.request_id]
            if decision.tenant_id in shadow_tenants:
                same_outcome(decision, got)
            else:  # enforced: exactly the decision of the all-enforce run
                assert not got.would_refuse
                assert (got.status_code, got.reason, got.gate, got.dispatch_ms) == (
                    decision.status_code, decision.reason, decision.gate, decision.dispatch_ms
                )  # fmt: skip


def test_switching_modes_is_a_reload_that_drops_nothing() -> None:
    # A queue built under Enforce; a reload to Shadow; every request still has exactly one
    # decision, the ones queued before the switch included, and refusals after it are served.
    config = config_of(POLICIES["serial"])
    scheduler = make_scheduler("tokenfair", config)
    trace = overload_trace(11, 120)
    outcomes: dict[str, Decision] = {}
    switched_at = trace[60].arrival_ms
    for request in trace[:60]:
        refusal = scheduler.submit(request, request.arrival_ms)
        if refusal is not None:
            outcomes[request.request_id] = refusal
    queued_before = scheduler.queued_total
    assert queued_before > 0
    scheduler.reconfigure(config_of(replace(config.policy, enforcement="Shadow")), switched_at)
    assert scheduler.queued_total == queued_before  # nothing dropped by the switch
    clock = switched_at
    for request in trace[60:]:
        clock = request.arrival_ms
        for expired in scheduler.expire(clock):
            outcomes[expired.request_id] = expired
        refusal = scheduler.submit(request, clock)
        if refusal is not None:
            outcomes[request.request_id] = refusal
    while scheduler.queued_total:
        for expired in scheduler.expire(clock):
            outcomes[expired.request_id] = expired
        decision = scheduler.next_dispatch(clock)
        if decision is None:
            wakeup = scheduler.next_wakeup_ms(clock)
            assert wakeup is not None
            clock = wakeup
            continue
        outcomes[decision.request_id] = decision
        if decision.admitted:
            scheduler.complete(decision.request_id, clock)
    assert set(outcomes) == {r.request_id for r in trace}
    late = [d for d in outcomes.values() if d.status_code != STATUS_OK]
    assert late, "the trace refused nothing"
    for decision in late:  # a refusal decided after the switch is shadowed
        decided_after = decision.gate == "queue" or decision.arrival_ms >= switched_at
        assert decision.would_refuse == decided_after, decision


def test_shadow_summary_shows_what_enforcement_would_have_done() -> None:
    trace = overload_trace(5)
    policy = POLICIES["serial"]
    enforced = summarize(simulate(config_of(policy), trace, "tokenfair"))
    shadowed = summarize(
        simulate(config_of(replace(policy, enforcement="Shadow")), trace, "tokenfair")
    )
    assert "would_refuse_requests" not in enforced  # the summary without shadow is unchanged
    assert shadowed["shed_429_requests"] == 0
    assert shadowed["would_refuse_requests"] == enforced["shed_429_requests"]
    assert shadowed["would_refuse_reasons"] == enforced["shed_reasons"]
    assert shadowed["admitted_requests"] == len(trace)
    for tenant_id, row in shadowed["tenants"].items():
        assert row["would_refuse"] == enforced["tenants"][tenant_id]["shed_429"]


def test_a_would_refuse_record_round_trips_and_plain_records_do_not_carry_it() -> None:
    decision = Decision("r1", "chat", "interactive", 200, "queue_full", "admission", 640, 3.0)
    plain = encode_record_line(decision_line(decision))
    assert b"would_refuse" not in plain
    decision.would_refuse = True
    line = encode_record_line(decision_line(decision))
    assert line.endswith(b',"would_refuse":true}')
    assert line == encode_record_line(decision_line(decision)) == _plain(decision)
    _, read = parse_decision(json.loads(line), "records:1")
    assert read.would_refuse
    assert read.reason == "queue_full"


def _plain(decision: Decision) -> bytes:
    return json.dumps(line_fields(decision_line(decision)), separators=(",", ":")).encode()


def test_enforcement_is_validated_and_rendered_only_when_shadow() -> None:
    with pytest.raises(ConfigError, match=r"policy\.enforcement: must be one of Enforce, Shadow"):
        parse_policy({"enforcement": "shadow"})
    with pytest.raises(ConfigError, match=r"t\.enforcement: must be one of Enforce, Shadow"):
        parse_tenant(
            {"weight": 1, "burstServiceTokens": 10, "sustainedServiceTokensPerSecond": 1,
             "enforcement": "DryRun"}, "t", default_id="a",
        )  # fmt: skip
    enforce = config_to_document(config_of(PolicyConfig()))
    assert "enforcement" not in enforce["policy"]  # type: ignore[operator]
    assert all("enforcement" not in t for t in enforce["tenants"])  # type: ignore[attr-defined]
    shadow = config_of(
        replace(PolicyConfig(), enforcement="Shadow"),
        (replace(TENANTS[0], enforcement="Enforce"), *TENANTS[1:]),
    )
    document = config_to_document(shadow)
    assert document["policy"]["enforcement"] == "Shadow"  # type: ignore[index]
    assert document["tenants"][0]["enforcement"] == "Enforce"  # type: ignore[index]
    assert loads_config(json.dumps(document)) == shadow


def test_the_fairness_report_counts_shadow_records_as_the_refusals_they_would_be() -> None:
    trace = overload_trace(9)
    policy = POLICIES["serial"]
    enforced = fairness_report(simulate(config_of(policy), trace, "tokenfair"), config_of(policy))
    shadow_config = config_of(replace(policy, enforcement="Shadow"))
    shadowed = fairness_report(simulate(shadow_config, trace, "tokenfair"), shadow_config)
    assert shadowed.admitted_then_expired == enforced.admitted_then_expired > 0
    for tenant_id, row in enforced.tenants.items():
        other = shadowed.tenants[tenant_id]
        assert other.refused_by_reason == row.refused_by_reason != {}
        assert (other.admitted_requests, other.served_requests) == (
            row.admitted_requests, row.served_requests
        )  # fmt: skip
