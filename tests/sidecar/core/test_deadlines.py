"""The deadline index of the scheduler (``core/deadlines.py``): same order as one heap of every
queued request, O(queued) memory, and expiry by deadline when a reload lowers a wait limit.

Behaviours under test:

* against a reference (the queued jobs' ``min (deadline_ms, seq)``) over random pushes in and
  out of order, in both lanes, with jobs leaving the queue at random: :meth:`earliest` is
  always the reference's, and :meth:`compact` keeps exactly the queued jobs;
* through the scheduler: a wait limit lowered by ``reconfigure`` gives later requests earlier
  deadlines than queued ones (the out-of-order path); ``expire`` refuses them first, each at its
  own deadline, and ``next_wakeup_ms`` follows the earliest one.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfair.config import PolicyConfig, PriorityClass, TenantConfig, build_config
from tokenfair.core import Request, make_scheduler
from tokenfair.core.deadlines import DeadlineQueue
from tokenfair.core.jobs import Job, JobState

# A push (lane 0/1, deadline in ms), or an index: the job pushed at that index, if any, leaves
# the queue.
Step = tuple[int, int] | int


def job(number: int, lane: int) -> Job:
    klass: PriorityClass = "interactive" if lane == 0 else "batch"
    return Job(Request(f"r{number}", "t", 0.0, 10, 1, klass), 14, 1)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.integers(0, 1), st.integers(0, 50)),  # push: small range, many ties
            st.integers(0, 60),  # the job pushed at that index leaves the queue
        ),
        max_size=80,
    ),
    st.integers(0, 10),
)
def test_earliest_is_the_least_queued_deadline_then_submission(
    steps: list[Step], compact_every: int
) -> None:
    queue = DeadlineQueue()
    pushed: list[tuple[float, int, Job]] = []  # (deadline, submission number, job)
    for number, step in enumerate(steps):
        if isinstance(step, tuple):
            lane, deadline = step
            entry = job(number, lane)
            queue.push(entry, float(deadline))
            pushed.append((float(deadline), number, entry))
        elif step < len(pushed):
            pushed[step][2].state = JobState.DISPATCHED
        queued = [p for p in pushed if p[2].state is JobState.QUEUED]
        expected = min(queued, key=lambda p: (p[0], p[1]))[2] if queued else None
        assert queue.earliest() is expected
        if compact_every and number % compact_every == 0:
            queue.compact()
            assert len(queue) == len(queued)
            assert queue.earliest() is expected


def test_a_push_below_its_lane_tail_is_still_found_first() -> None:
    queue = DeadlineQueue()
    late, early = job(1, 0), job(2, 0)
    queue.push(late, 500.0)
    queue.push(early, 100.0)  # out of order: held apart from the lane's FIFO
    assert queue.earliest() is early
    early.state = JobState.DISPATCHED
    assert queue.earliest() is late
    late.state = JobState.DISPATCHED
    assert queue.earliest() is None
    assert len(queue) == 0  # both dropped on the way


def test_equal_deadlines_go_in_submission_order_across_lanes() -> None:
    queue = DeadlineQueue()
    batch, interactive = job(1, 1), job(2, 0)
    queue.push(batch, 300.0)
    queue.push(interactive, 300.0)
    assert queue.earliest() is batch


def test_a_lowered_wait_limit_expires_the_later_requests_first() -> None:
    tenants = (TenantConfig("a", 1.0, 10**9, 10**9, "interactive"),)
    policy = PolicyConfig(max_interactive_wait_ms=1000.0)
    config = build_config(policy, tenants)
    scheduler = make_scheduler("tokenfair", config)
    # Nothing dispatches (no `next_dispatch`): every request stays queued.
    assert scheduler.submit(Request("slow", "a", 0.0, 100, 10, "interactive"), 0.0) is None
    lowered = build_config(dataclasses.replace(policy, max_interactive_wait_ms=100.0), tenants)
    scheduler.reconfigure(lowered, 10.0)
    assert scheduler.submit(Request("fast", "a", 10.0, 100, 10, "interactive"), 10.0) is None
    wakeup = scheduler.next_wakeup_ms(10.0)
    assert wakeup is not None
    assert 110.0 < wakeup < 110.001  # "fast": 10 + 100
    assert [d.request_id for d in scheduler.expire(110.0)] == []  # deadline 110: not past
    assert [d.request_id for d in scheduler.expire(111.0)] == ["fast"]
    wakeup = scheduler.next_wakeup_ms(111.0)
    assert wakeup is not None
    assert 1000.0 < wakeup < 1000.001  # "slow": 0 + 1000
    assert [d.request_id for d in scheduler.expire(999.0)] == []
    assert [d.request_id for d in scheduler.expire(1001.0)] == ["slow"]
    assert scheduler.next_wakeup_ms(1001.0) is None
    assert len(scheduler._deadlines) == 0


def test_remove_takes_the_earliest_out_wherever_it_is_held() -> None:
    queue = DeadlineQueue()
    in_fifo, in_heap, other = job(1, 0), job(2, 0), job(3, 1)
    queue.push(in_fifo, 500.0)
    queue.push(in_heap, 100.0)  # below its lane's tail: the heap
    queue.push(other, 900.0)
    assert queue.earliest() is in_heap
    queue.remove(in_heap)
    assert queue.earliest() is in_fifo  # still queued: found without the removed one
    queue.remove(in_fifo)
    assert queue.earliest() is other
    assert len(queue) == 1
    with pytest.raises(ValueError, match="'r1' is not the earliest deadline"):
        queue.remove(in_fifo)
