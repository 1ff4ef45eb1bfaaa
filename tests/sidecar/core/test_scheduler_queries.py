"""The core's read-only answers to the server (issue 31: the server never reads ``jobs`` or a
bucket): a tenant's budget and figures, the backlog of dispatched requests per lane, whether a
request still runs, the job whose KV the books hold, and what a settlement booked.

Behaviours: each answer follows the request through admission, dispatch, settlement and KV
release; the budget is the bucket refilled to the instant asked (reading it twice at one
instant gives one answer) and None for a tenant the scheduler does not know; a tenant's view
reads its queue, its served service and that budget at one instant; ``complete`` returns the
service tokens it booked and whether they are the estimate (no usage given).
"""

from __future__ import annotations

from tokenfair.config import Config, PolicyConfig, TenantConfig, build_config
from tokenfair.core import Request, Settled, TenantView, make_scheduler
from tokenfair.core.jobs import Lane
from tokenfair.core.scheduler import BudgetView

BURST = 10_000
RATE = 100.0  # service tokens per second


def config(policy: PolicyConfig | None = None) -> Config:
    tenants = [
        TenantConfig("chat", 1.0, BURST, RATE, "interactive"),
        TenantConfig("bulk", 1.0, BURST, RATE, "batch"),
    ]
    return build_config(policy or PolicyConfig(), tenants, "queries")


def test_the_answers_follow_a_request_from_queue_to_kv_release() -> None:
    scheduler = make_scheduler("tokenfair", config(), 0.0)
    request = Request("r1", "chat", 0.0, 100, 50, "interactive")
    assert scheduler.running_backlog() == [0, 0]
    assert scheduler.submit(request, 0.0) is None  # queued
    assert (scheduler.is_running("r1"), scheduler.held_job("r1")) == (False, None)
    decision = scheduler.next_dispatch(0.0)
    assert decision is not None
    assert decision.admitted
    assert scheduler.is_running("r1")
    held = scheduler.held_job("r1")
    assert held is not None
    assert held.request is request
    backlog = scheduler.running_backlog()
    assert backlog[Lane.INTERACTIVE] == decision.service_tokens
    assert backlog[Lane.BATCH] == 0
    scheduler.complete("r1", 10.0, None, release_kv=False)
    assert not scheduler.is_running("r1")
    assert scheduler.running_backlog() == [0, 0]
    assert scheduler.held_job("r1") is held  # settled, its KV still held
    scheduler.release_kv("r1")
    assert scheduler.held_job("r1") is None
    assert not scheduler.is_running("unknown")
    assert scheduler.held_job("unknown") is None


def test_the_budget_is_the_bucket_refilled_to_the_instant_asked() -> None:
    scheduler = make_scheduler("tokenfair", config(), 0.0)
    assert scheduler.budget("nobody", 0.0) is None
    full = scheduler.budget("chat", 0.0)
    assert full is not None
    assert (full.burst, full.level, full.sustained_per_second) == (BURST, BURST, RATE)
    scheduler.submit(Request("r1", "chat", 0.0, 1000, 500, "interactive"), 0.0)
    decision = scheduler.next_dispatch(0.0)
    assert decision is not None
    assert decision.admitted
    spent = scheduler.budget("chat", 0.0)
    assert spent is not None
    assert spent.level == BURST - decision.service_tokens
    later = scheduler.budget("chat", 2000.0)  # 2 s at 100 service tokens a second
    assert later is not None
    assert later.level == spent.level + 200.0
    assert scheduler.budget("chat", 2000.0) == later  # one instant, one answer
    untouched = scheduler.budget("bulk", 2000.0)
    assert untouched is not None
    assert untouched.level == BURST


def test_complete_returns_what_it_booked() -> None:
    scheduler = make_scheduler("tokenfair", config(), 0.0)
    for request_id in ("r1", "r2"):
        scheduler.submit(Request(request_id, "chat", 0.0, 100, 50, "interactive"), 0.0)
    first = scheduler.next_dispatch(0.0)
    second = scheduler.next_dispatch(0.0)
    assert first is not None
    assert second is not None
    assert first.service_tokens != 123
    assert scheduler.complete("r1", 10.0, 123) == Settled(123, at_estimate=False)
    assert first.actual_service_tokens == 123
    assert scheduler.complete("r2", 10.0) == Settled(second.service_tokens, at_estimate=True)
    assert second.actual_service_tokens == second.service_tokens


def test_a_tenant_view_reads_its_queue_service_and_budget_at_one_instant() -> None:
    scheduler = make_scheduler("tokenfair", config(), 0.0)
    assert scheduler.tenant_ids() == ["chat", "bulk"]
    assert scheduler.tenant_view("nobody", 0.0) is None
    assert scheduler.tenant_view("chat", 0.0) == TenantView(
        "interactive", 1.0, 0, 0, 0, BudgetView(BURST, BURST, RATE)
    )
    scheduler.submit(Request("r1", "chat", 0.0, 1000, 500, "interactive"), 0.0)
    scheduler.submit(Request("r2", "chat", 0.0, 100, 50, "interactive"), 0.0)
    queued = scheduler.tenant_view("chat", 0.0)
    assert queued is not None
    assert (queued.queued_requests, queued.served_service_tokens) == (2, 0)
    decision = scheduler.next_dispatch(0.0)
    assert decision is not None
    assert decision.request_id == "r1"
    view = scheduler.tenant_view("chat", 0.0)
    assert view is not None
    assert view.queued_requests == 1
    assert view.queued_service_tokens == queued.queued_service_tokens - decision.service_tokens
    assert view.served_service_tokens == decision.service_tokens
    assert view.budget == scheduler.budget("chat", 0.0)
    scheduler.complete("r1", 1000.0, 100)
    settled = scheduler.tenant_view("chat", 1000.0)
    assert settled is not None
    assert settled.served_service_tokens == 100
    assert settled.budget == scheduler.budget("chat", 1000.0)
    assert settled.budget.level > view.budget.level
