"""Benchmark of the scheduling core: simulate() against the lesson's O(n) bookkeeping (the oracle).

Not part of the test suite (speed is measured here only). One run prints three sets of figures:

1. **relaxed regime** — wait limits, queue bounds and KV capacity raised so nothing is shed for
   them and the backlog grows without bound: an overloaded 3-tenant trace (about 1.4x the server's
   45 service tokens/ms) at each of ``--sizes`` through ``simulate()`` for
   ``service_token_drr_with_admission`` and ``tokenfair``, then through the oracle
   (``tests/lesson_reference.py``, the lab's sums over queues and resident requests) at the small
   ``--oracle-sizes``. Running totals keep our cost per request flat; the oracle's grows with the
   backlog (quadratic over the trace).
2. **default regime** — the lesson's default parameters (the KV watermark and wait limits bound
   the backlog) on the same kind of trace: our per-request cost and the oracle's, side by side,
   for both lesson policies, and their ratio.
3. **many tenants** — ``tokenfair`` with N = ``--tenant-counts`` backlogged tenants in one lane
   (budgets, waits and queue bounds unbounded): microseconds per ``submit`` (a backlogged
   tenant, a returning one that joins the ring at its tail, new ones that join it ahead) and
   per ``next_dispatch`` + ``complete`` (every head eligible; most tenants throttled; both
   lanes waiting), and per ``next_wakeup_ms``, with the ratio largest N / smallest N.

Times are of the replay alone (trace generation excluded): ``time.perf_counter`` wall seconds
and ``time.process_time`` CPU seconds, each the best of ``--repeat`` runs where a run takes under
a second, else of one run. ``--gc-off`` disables the cyclic collector during replays. The
many-tenant table times each call alone (``perf_counter_ns``; setup and refills untimed), the
collector off, best of ``--repeat`` fresh setups.

    .venv/bin/python bench/bench_core.py                 # full run (~5 min on a shared 2-core box)
    .venv/bin/python bench/bench_core.py --quick         # smoke run, a few seconds
    .venv/bin/python bench/bench_core.py --sizes 10000,100000 --oracle-sizes 4000,8000
    .venv/bin/python bench/bench_core.py --tenants-only --tenant-counts 100,1000,10000

Figures and how to read them: bench/README.md.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import NamedTuple, TypeVar

# The oracle is a test helper (tests/ is on sys.path under pytest; here we put it there).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tokenfair import native

# Before the core is imported, as the `tokenfair` command does: this process times the
# compiled core when a fresh build is there (docs/native.md).
native.activate()

from lesson_bridge import DRR, NAIVE, ORACLES, oracle_inputs  # noqa: E402
from lesson_reference import (  # noqa: E402
    OracleOutcome,
    run_service_token_drr,
)

from tokenfair import core as core_package  # noqa: E402
from tokenfair.config import (  # noqa: E402
    Config,
    PolicyConfig,
    PriorityClass,
    TenantConfig,
    build_config,
)
from tokenfair.core import Decision, Lane, Request, make_scheduler  # noqa: E402
from tokenfair.sim.scenarios import LESSON_TENANTS  # noqa: E402
from tokenfair.sim.simulator import simulate  # noqa: E402

TOKENFAIR = "tokenfair"
RELAXED_WAIT_MS = 1e12
RELAXED_QUEUE_BOUND = 100_000_000
RELAXED_KV_BLOCKS = 1_000_000_000
TRACE_SEED = 20261129

T = TypeVar("T")


def overloaded_trace(count: int, seed: int = TRACE_SEED) -> list[Request]:
    """``count`` requests of the lesson's three tenants; integer gaps of 0..40 ms (mean 20 ms).

    Mean cost: chat 350 + 4*85 = 690, ide 500 + 4*55 = 720, batch 2500 + 4*250 = 3500 service
    tokens; mixed 45/35/20 that is ~1262 tokens every 20 ms = ~63 tokens/ms against 45 served.
    """
    rng = random.Random(seed)
    requests: list[Request] = []
    arrival_ms = 0
    klass: PriorityClass
    for i in range(count):
        arrival_ms += rng.randint(0, 40)
        pick = rng.random()
        if pick < 0.45:
            tenant, klass = "tenant_chat_pro", "interactive"
            prefill, decode = rng.randint(100, 600), rng.randint(20, 150)
        elif pick < 0.80:
            tenant, klass = "tenant_ide_assist", "interactive"
            prefill, decode = rng.randint(200, 800), rng.randint(10, 100)
        else:
            tenant, klass = "tenant_batch_rag", "batch"
            prefill, decode = rng.randint(1000, 4000), rng.randint(100, 400)
        requests.append(Request(f"r{i:07d}", tenant, arrival_ms, prefill, decode, klass))
    return requests


def relaxed_config() -> Config:
    """The lesson's tenants with nothing shed for waiting, queueing or KV: the backlog grows."""
    policy = PolicyConfig(
        max_interactive_wait_ms=RELAXED_WAIT_MS,
        max_batch_wait_ms=RELAXED_WAIT_MS,
        max_queued_requests=RELAXED_QUEUE_BOUND,
        max_queued_requests_per_tenant=RELAXED_QUEUE_BOUND,
        total_kv_blocks=RELAXED_KV_BLOCKS,
    )
    return build_config(policy, LESSON_TENANTS)


def default_config() -> Config:
    return build_config(PolicyConfig(), LESSON_TENANTS)


class Timing(NamedTuple):
    """Best wall-clock and best CPU seconds over the repeats of one replay."""

    wall_s: float
    cpu_s: float


def timed(run: Callable[[], T], repeat: int, collect: bool = True) -> tuple[Timing, T]:
    """Best times of up to ``repeat`` runs (a run over a second is not repeated).

    CPU time (``time.process_time``) is printed next to wall time because the machine is shared:
    other processes stretch wall time, much less the CPU time of a single-threaded replay.
    """
    best_wall_s = best_cpu_s = float("inf")
    result: T | None = None
    for attempt in range(max(1, repeat)):
        result = None  # drop the previous run's records before the next one
        gc.collect()
        if not collect:
            gc.disable()
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        result = run()
        wall_s = time.perf_counter() - wall_start
        best_cpu_s = min(best_cpu_s, time.process_time() - cpu_start)
        gc.enable()
        best_wall_s = min(best_wall_s, wall_s)
        if attempt == 0 and wall_s > 1.0:
            break
    assert result is not None
    return Timing(best_wall_s, best_cpu_s), result


def max_wait_s(rows: Sequence[Decision] | Sequence[OracleOutcome]) -> float:
    return max((r.queue_wait_ms for r in rows), default=0.0) / 1000.0


def row(label: str, size: int, timing: Timing, admitted: int, longest_wait_s: float) -> str:
    return (
        f"  {label:<42}{size:>9}{timing.wall_s:>9.3f}{timing.wall_s / size * 1e6:>9.2f}"
        f"{timing.cpu_s:>9.3f}{timing.cpu_s / size * 1e6:>9.2f}"
        f"{admitted:>9}{longest_wait_s:>11.1f}"
    )


HEADER = (
    f"  {'implementation / policy':<42}{'requests':>9}{'wall s':>9}{'wall us':>9}"
    f"{'cpu s':>9}{'cpu us':>9}{'admitted':>9}{'max wait s':>11}"
)


def bench_relaxed(
    sizes: Sequence[int], oracle_sizes: Sequence[int], cap_s: float, repeat: int, collect: bool
) -> None:
    config = relaxed_config()
    print("relaxed regime: waits/queues/KV unbounded, ~1.4x overload, the backlog grows")
    print(HEADER)
    runs: dict[str, list[tuple[int, Timing]]] = {DRR: [], TOKENFAIR: [], f"oracle {DRR}": []}
    for size in sizes:
        trace = overloaded_trace(size)
        gc.collect()
        gc.freeze()  # the input trace is long-lived: keep it out of the collector's scans
        for policy in (DRR, TOKENFAIR):
            timing, decisions = timed(partial(simulate, config, trace, policy), repeat, collect)
            admitted = sum(1 for d in decisions if d.admitted)
            print(row(f"simulate {policy}", size, timing, admitted, max_wait_s(decisions)))
            runs[policy].append((size, timing))
            del decisions
        del trace
        gc.unfreeze()
    last: tuple[int, Timing] | None = None
    for size in oracle_sizes:
        if last is not None and last[1].wall_s * (size / last[0]) ** 2 > cap_s:
            print(
                f"  oracle {DRR}: {size} skipped (quadratic estimate above --oracle-cap {cap_s} s)"
            )
            continue
        tenants, oracle_trace, knobs = oracle_inputs(config, overloaded_trace(size))
        run = partial(run_service_token_drr, tenants, oracle_trace, knobs)
        timing, outcomes = timed(run, repeat, collect)
        admitted = sum(1 for o in outcomes if o.status_code == 200)
        print(row(f"oracle {DRR}", size, timing, admitted, max_wait_s(outcomes)))
        runs[f"oracle {DRR}"].append((size, timing))
        last = (size, timing)
    ours = ", ".join(
        f"{size} {tf.cpu_s / drr.cpu_s:.2f}"
        for (size, drr), (_, tf) in zip(runs[DRR], runs[TOKENFAIR], strict=True)
    )
    print(f"  cost per request, {TOKENFAIR} / {DRR} (cpu, same run): {ours}")
    for label, measured in runs.items():
        if len(measured) > 1:
            (small, first), (large, final) = measured[0], measured[-1]
            print(
                f"  cost per request, {large} / {small} requests, {label}: "
                f"wall {final.wall_s / large / (first.wall_s / small):.2f}, "
                f"cpu {final.cpu_s / large / (first.cpu_s / small):.2f}"
            )


def bench_default(size: int, repeat: int, collect: bool) -> None:
    config = default_config()
    requests = overloaded_trace(size)
    tenants, trace, knobs = oracle_inputs(config, requests)
    print(f"default regime: lesson defaults (bounded backlog), same trace of {size} requests")
    print(HEADER + f"{'ratio wall':>11}{'ratio cpu':>10}")
    for policy in (NAIVE, DRR):
        ours_t, decisions = timed(partial(simulate, config, requests, policy), repeat, collect)
        oracle = ORACLES[policy]
        oracle_t, outcomes = timed(partial(oracle, tenants, trace, knobs), repeat, collect)
        same = [
            (d.request_id, d.status_code, d.reason, d.ttft_ms, d.queue_wait_ms) for d in decisions
        ] == [(o.request_id, o.status_code, o.reason, o.ttft_ms, o.queue_wait_ms) for o in outcomes]
        admitted = sum(1 for d in decisions if d.admitted)
        print(row(f"simulate {policy}", size, ours_t, admitted, max_wait_s(decisions)))
        print(
            row(
                f"oracle {policy}",
                size,
                oracle_t,
                sum(1 for o in outcomes if o.status_code == 200),
                max_wait_s(outcomes),
            )
            + f"{oracle_t.wall_s / ours_t.wall_s:>9.2f}{oracle_t.cpu_s / ours_t.cpu_s:>9.2f}"
        )
        print(f"    same decisions as the oracle: {same}")


# ---------------------------------------------------------------------------------------------
# Many tenants: the cost of one decision as the number of backlogged tenants grows.

TENANT_COUNTS = (100, 1_000, 10_000)
TENANT_OPS = 1_000
QUEUED_PER_TENANT = 3
WITHIN_BUDGET_TENANTS = 10
MAX_REQUEST_TOKENS = 2_000  # 1000 prefill + 4 * 250 decode: the largest request below
UNBOUNDED_BUDGET = 10**12
THROTTLED_RATE = 1e-3  # service tokens per second: a spent budget stays spent for the run
MANY_SEED = 20261201
WAKEUP_OPS_DIVISOR = 5  # `next_wakeup_ms` is O(tenants): fewer calls keep the run short


class Measured(NamedTuple):
    """One timed run of a many-tenant row."""

    total_ns: int
    ops: int
    joined: int | None = None
    """Admissions that joined the ring ahead (None: not an admission row, or a core without
    join-ahead)."""
    joiners: tuple[float, int] | None = None
    """Tenants waiting for their first turn ahead when each admission came: mean, max."""


class Row(NamedTuple):
    """One line of the many-tenant table."""

    label: str
    grows: str  # what the cost per operation should grow with
    run: Callable[[int, int], Measured]  # (tenants, operations)
    ops: Callable[[int, int], int]  # (tenants, --tenant-ops) -> operations timed
    ops_label: str


def many_tenant_policy() -> PolicyConfig:
    return PolicyConfig(
        max_interactive_wait_ms=RELAXED_WAIT_MS,
        max_batch_wait_ms=RELAXED_WAIT_MS,
        max_queued_requests=10**7,
        max_queued_requests_per_tenant=10**6,
    )


class Crowd:
    """A ``tokenfair`` scheduler with ``tenants`` backlogged tenants (``b*``, weights 1/2/4,
    ``QUEUED_PER_TENANT`` requests of 400-2000 service tokens each) in one lane, and the lane's
    recent service coming from ``returning`` tenants (``r*``, weight 1) that were each served
    one 400-token request and drained: so a tenant that was never served (``f*``, weight 1)
    has less than its weighted share and joins the ring ahead, while a returning one (served
    more than its share) joins at the tail. Budgets are unbounded but for the ``throttled``
    backlogged tenants (all but ``WITHIN_BUDGET_TENANTS`` spread evenly), whose buckets are
    emptied after the setup."""

    def __init__(
        self,
        tenants: int,
        fresh: int,
        returning: int,
        *,
        throttled: bool = False,
        backlog_class: PriorityClass = "interactive",
    ) -> None:
        self.rng = random.Random(MANY_SEED + tenants)
        self.backlogged = [f"b{i:06d}" for i in range(tenants)]
        self.returning = [f"r{i:06d}" for i in range(returning)]
        self.fresh = [f"f{i:06d}" for i in range(fresh)]
        stride = max(1, tenants // WITHIN_BUDGET_TENANTS)
        within = set(self.backlogged[::stride][:WITHIN_BUDGET_TENANTS]) if throttled else None
        configs = [
            TenantConfig(
                tenant_id,
                (1.0, 2.0, 4.0)[i % 3],
                UNBOUNDED_BUDGET if within is None or tenant_id in within else MAX_REQUEST_TOKENS,
                UNBOUNDED_BUDGET if within is None or tenant_id in within else THROTTLED_RATE,
                backlog_class,
            )
            for i, tenant_id in enumerate(self.backlogged)
        ]
        self.interactive = "i000000"  # backlogged in the other lane when the crowd is batch
        if backlog_class != "interactive":
            configs.append(TenantConfig(self.interactive, 1.0, UNBOUNDED_BUDGET, UNBOUNDED_BUDGET))
        configs += [
            TenantConfig(tenant_id, 1.0, UNBOUNDED_BUDGET, UNBOUNDED_BUDGET)
            for tenant_id in self.returning + self.fresh
        ]
        self.scheduler = make_scheduler(TOKENFAIR, build_config(many_tenant_policy(), configs))
        self.rate = self.scheduler.policy.service_tokens_per_ms
        self.now_ms = 0.0
        self.sequence = 0
        self.classes = {c.tenant_id: c.priority_class for c in configs}
        # The returning tenants first (the lane has served nothing: everybody joins at the tail)...
        for tenant_id in self.returning:
            self.admit(self.request(tenant_id, 200, 50))
        for tenant_id in self.backlogged:
            for _ in range(QUEUED_PER_TENANT):
                self.admit(self.request(tenant_id))
        if backlog_class != "interactive":
            for _ in range(QUEUED_PER_TENANT):
                self.admit(self.request(self.interactive))
        # ...and at the front of the ring: they are served first, and drain.
        for _ in self.returning:
            self.serve()
        drained = all(self.scheduler.tenants[t].queued == 0 for t in self.returning)
        assert drained, "the returning tenants were not served first"
        if within is not None:
            for tenant_id in self.backlogged:
                if tenant_id not in within:
                    self.scheduler.tenants[tenant_id].bucket.level = 0.0

    def request(self, tenant_id: str, prefill: int = 0, decode: int = 0) -> Request:
        """A request of ``tenant_id`` arriving now (400-2000 service tokens unless given)."""
        self.sequence += 1
        if not prefill:
            prefill, decode = self.rng.randint(200, 1_000), self.rng.randint(50, 250)
        klass = self.classes[tenant_id]
        return Request(f"q{self.sequence:08d}", tenant_id, self.now_ms, prefill, decode, klass)

    def admit(self, request: Request) -> None:
        refusal = self.scheduler.submit(request, self.now_ms)
        assert refusal is None, f"{request.tenant_id} refused: {refusal}"

    def serve(self) -> str:
        """Dispatch one request, run it to completion; returns its tenant."""
        decision = self.scheduler.next_dispatch(self.now_ms)
        assert decision is not None, "nothing was dispatched"
        assert decision.admitted, f"refused at dispatch: {decision}"
        self.now_ms += decision.service_tokens / self.rate
        self.scheduler.complete(decision.request_id, self.now_ms)
        return decision.tenant_id

    def _lane_state(self, tenant_id: str) -> tuple[object, object]:
        """The tenant's lane (a ``DeficitRoundRobin``) and its queue there, read by name so
        that a core without these attributes (an older one) reads as None."""
        lanes = getattr(self.scheduler, "_lanes", None)
        if lanes is None:
            return None, None
        lane = lanes[Lane.of(self.classes[tenant_id])]
        return lane, lane.queues[tenant_id]

    def in_ring(self, tenant_id: str) -> bool:
        """Is the tenant in its lane's ring (backlogged) now?"""
        return bool(getattr(self._lane_state(tenant_id)[1], "in_active", False))

    def joined_ahead(self, tenant_id: str, was_in_ring: bool) -> bool | None:
        """Did the tenant's last admission join the ring ahead (waiting for its first turn
        behind the front, or at the front itself, which a joiner takes when the front has not
        started its turn)? None: no join-ahead here."""
        lane, queue = self._lane_state(tenant_id)
        flag = getattr(queue, "joined_ahead", None)
        if flag is None:
            return None
        active: Sequence[object] = getattr(lane, "active", ())
        at_front = not was_in_ring and len(active) > 1 and active[0] is queue
        return bool(flag) or at_front

    def joiners_waiting(self, tenant_id: str) -> int | None:
        """Tenants waiting for their first turn ahead in the tenant's lane (None: see above)."""
        count = getattr(self._lane_state(tenant_id)[0], "ahead_joiners", None)
        return None if count is None else int(count)


def _timed_submits(
    crowd: Crowd, tenant_ids: Sequence[str], between: Callable[[], None] | None = None
) -> Measured:
    """One request of each tenant, submitted now (each call timed alone); ``between`` runs
    untimed after each. Returns (ns in all, operations, how many joined the ring ahead)."""
    clock = time.perf_counter_ns
    submit = crowd.scheduler.submit
    total_ns = 0
    refused = 0
    flags: list[bool | None] = []
    waiting: list[int | None] = []
    for tenant_id in tenant_ids:
        request = crowd.request(tenant_id)
        now_ms = crowd.now_ms
        waiting.append(crowd.joiners_waiting(tenant_id))
        was_in_ring = crowd.in_ring(tenant_id)
        start = clock()
        refusal = submit(request, now_ms)
        total_ns += clock() - start
        refused += refusal is not None
        flags.append(crowd.joined_ahead(tenant_id, was_in_ring))
        if between is not None:
            between()
    assert not refused, f"{refused} refusals in a many-tenant run"
    ops = len(tenant_ids)
    if not ops or any(f is None for f in flags):
        return Measured(total_ns, ops)
    joined = sum(1 for f in flags if f)
    if any(w is None for w in waiting):
        return Measured(total_ns, ops, joined)
    known = [w for w in waiting if w is not None]
    return Measured(total_ns, ops, joined, (sum(known) / ops, max(known)))


def admit_backlogged(tenants: int, ops: int) -> Measured:
    crowd = Crowd(tenants, 0, ops)
    ids = crowd.backlogged
    return _timed_submits(crowd, [ids[i % len(ids)] for i in range(ops)])


def admit_returning(tenants: int, ops: int) -> Measured:
    crowd = Crowd(tenants, 0, ops)
    return _timed_submits(crowd, crowd.returning)


def admit_new_interleaved(tenants: int, ops: int) -> Measured:
    crowd = Crowd(tenants, ops, ops)
    backlogged = set(crowd.backlogged)

    def serve_one() -> None:
        tenant_id = crowd.serve()
        if tenant_id in backlogged:  # keep it backlogged
            crowd.admit(crowd.request(tenant_id))

    return _timed_submits(crowd, crowd.fresh, serve_one)


def admit_new_burst(tenants: int, ops: int) -> Measured:
    crowd = Crowd(tenants, tenants, ops)
    return _timed_submits(crowd, crowd.fresh)


def _timed_selections(crowd: Crowd, ops: int) -> Measured:
    """``next_dispatch`` + ``complete`` (timed), then the dispatched request's tenant sends a
    replacement (untimed): the backlog stays as it was."""
    clock = time.perf_counter_ns
    scheduler = crowd.scheduler
    next_dispatch, complete = scheduler.next_dispatch, scheduler.complete
    rate = crowd.rate
    total_ns = 0
    for _ in range(ops):
        now_ms = crowd.now_ms
        start = clock()
        decision = next_dispatch(now_ms)
        assert decision is not None
        end_ms = now_ms + decision.service_tokens / rate
        complete(decision.request_id, end_ms)
        total_ns += clock() - start
        crowd.now_ms = end_ms
        crowd.admit(crowd.request(decision.tenant_id))
    return Measured(total_ns, ops)


def select_eligible(tenants: int, ops: int) -> Measured:
    return _timed_selections(Crowd(tenants, 0, ops), ops)


def select_throttled(tenants: int, ops: int) -> Measured:
    return _timed_selections(Crowd(tenants, 0, ops, throttled=True), ops)


def select_two_lanes(tenants: int, ops: int) -> Measured:
    return _timed_selections(Crowd(tenants, 0, 0, backlog_class="batch"), ops)


def next_wakeup(tenants: int, ops: int) -> Measured:
    crowd = Crowd(tenants, 0, ops)
    clock = time.perf_counter_ns
    wakeup = crowd.scheduler.next_wakeup_ms
    now_ms = crowd.now_ms
    total_ns = 0
    for _ in range(ops):
        start = clock()
        wakeup(now_ms)
        total_ns += clock() - start
    return Measured(total_ns, ops)


def _fixed(_: int, ops: int) -> int:
    return ops


MANY_TENANT_ROWS = (
    Row("submit: backlogged tenant", "O(1)", admit_backlogged, _fixed, "ops"),
    Row("submit: returning tenant, joins at the tail", "O(1)", admit_returning, _fixed, "ops"),
    Row(
        "submit: new tenant joins ahead, 1 dispatch between",
        "O(joiners waiting): see checks",
        admit_new_interleaved,
        _fixed,
        "ops",
    ),
    Row(
        "submit: new tenants join ahead, burst of N",
        "O(joiners waiting): 0..N-1 here",
        admit_new_burst,
        lambda tenants, _: tenants,
        "N",
    ),
    Row("dispatch+complete: every head eligible", "amortised O(1)", select_eligible, _fixed, "ops"),
    Row(
        f"dispatch+complete: {WITHIN_BUDGET_TENANTS} within budget, rest throttled",
        "O(throttled tenants) per pick",
        select_throttled,
        _fixed,
        "ops",
    ),
    Row(
        "dispatch+complete: N batch + 1 interactive",
        "O(log batch tenants): min_head_cost heap",
        select_two_lanes,
        _fixed,
        "ops",
    ),
    Row(
        "next_wakeup_ms (the sidecar: once per pump)",
        "O(active tenants)",
        next_wakeup,
        lambda _, ops: max(1, ops // WAKEUP_OPS_DIVISOR),
        f"ops/{WAKEUP_OPS_DIVISOR}",
    ),
)


def best_of(row: Row, tenants: int, ops: int, repeat: int) -> Measured:
    """The fastest of up to ``repeat`` runs, each on a fresh setup (a run over a second is not
    repeated), with the cyclic collector off while a run is timed."""
    best: Measured | None = None
    for attempt in range(max(1, repeat)):
        gc.collect()
        gc.disable()
        try:
            measured = row.run(tenants, row.ops(tenants, ops))
        finally:
            gc.enable()
        if best is None or measured.total_ns < best.total_ns:
            best = measured
        if attempt == 0 and measured.total_ns > 1e9:
            break
    assert best is not None
    return best


def bench_many_tenants(counts: Sequence[int], ops: int, repeat: int) -> None:
    print(
        f"many tenants: {TOKENFAIR}, N backlogged tenants in one lane, {QUEUED_PER_TENANT} "
        "queued requests each (400-2000 service tokens, weights 1/2/4); budgets, wait limits "
        "and queue bounds unbounded; gc off"
    )
    print(
        f"  wall us per operation (perf_counter around each call), best of {repeat}; "
        f"ops = --tenant-ops = {ops}"
    )
    sizes = "".join(f"{f'N={n}':>10}" for n in counts)
    ratio_label = f"{counts[-1]}/{counts[0]}" if len(counts) > 1 else "ratio"
    print(f"  {'operation':<52}{'ops':>6}{sizes}{ratio_label:>11}  cost grows with")
    notes: list[str] = []
    for row in MANY_TENANT_ROWS:
        cells: list[float] = []
        for tenants in counts:
            measured = best_of(row, tenants, ops, repeat)
            cells.append(measured.total_ns / measured.ops / 1e3)
            if measured.joined is not None:
                note = f"{row.label}, N={tenants}: {measured.joined} of {measured.ops} joined ahead"
                if measured.joiners is not None:
                    mean, most = measured.joiners
                    note += f"; joiners waiting at each admission: mean {mean:.1f}, max {most}"
                notes.append(note)
        ratio = f"{cells[-1] / cells[0]:>11.2f}" if len(cells) > 1 else f"{'-':>11}"
        values = "".join(f"{c:>10.2f}" for c in cells)
        print(f"  {row.label:<52}{row.ops_label:>6}{values}{ratio}  {row.grows}")
    if notes:
        print("  checks (the path each admission took):")
        for note in notes:
            print(f"    {note}")
    else:
        print("  checks: this core has no join-ahead (every new tenant joins at the tail)")


def parse_sizes(text: str) -> list[int]:
    return [int(part.replace("_", "")) for part in text.split(",") if part.strip()]


def core_kind() -> str:
    """Which core this process (and the commands it starts) runs: compiled or interpreted
    (docs/native.md). ``bench_simulate.py`` and ``bench_fairness.py`` print it too."""
    try:
        from tokenfair import native
    except ImportError:  # a tree from before the compiled core (PYTHONPATH at another checkout)
        return "interpreted core (a tree without tokenfair.native)"
    return native.status().describe()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=[10_000, 100_000, 1_000_000],
        help="relaxed-regime trace sizes for simulate() (default 10k,100k,1M)",
    )
    parser.add_argument(
        "--oracle-sizes",
        type=parse_sizes,
        default=[8_000, 16_000, 32_000],
        help="relaxed-regime trace sizes for the quadratic oracle",
    )
    parser.add_argument(
        "--oracle-cap",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="skip an oracle size whose quadratic estimate exceeds this",
    )
    parser.add_argument(
        "--default-size",
        type=int,
        default=20_000,
        help="trace size of the default-regime comparison",
    )
    parser.add_argument("--repeat", type=int, default=3, help="best of N for runs under 1 s")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes for a smoke run (overrides the size flags)",
    )
    parser.add_argument(
        "--gc-off",
        action="store_true",
        help="disable the cyclic garbage collector during each replay (shows its share)",
    )
    parser.add_argument(
        "--tenant-counts",
        type=parse_sizes,
        default=list(TENANT_COUNTS),
        help="backlogged tenants of the many-tenant table (default 100,1000,10000)",
    )
    parser.add_argument(
        "--tenant-ops",
        type=int,
        default=TENANT_OPS,
        help=f"operations timed per cell of the many-tenant table (default {TENANT_OPS})",
    )
    sections = parser.add_mutually_exclusive_group()
    sections.add_argument("--tenants-only", action="store_true", help="only the many-tenant table")
    sections.add_argument("--no-tenants", action="store_true", help="skip the many-tenant table")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.oracle_sizes, args.default_size = [2_000, 5_000], [1_000, 2_000], 2_000
        args.tenant_counts, args.tenant_ops = [100, 1_000], 200
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    collector = "off" if args.gc_off else "on"
    print(
        f"python {sys.version.split()[0]}, load average {load}, seed {TRACE_SEED}, "
        f"gc {collector} during replays"
    )
    print(f"core: {Path(core_package.__file__ or '?').parent}, {core_kind()}")
    if not args.tenants_only:
        bench_relaxed(args.sizes, args.oracle_sizes, args.oracle_cap, args.repeat, not args.gc_off)
        bench_default(args.default_size, args.repeat, not args.gc_off)
    if not args.no_tenants:
        bench_many_tenants(args.tenant_counts, args.tenant_ops, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
