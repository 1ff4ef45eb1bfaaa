"""The live fairness signal (``server/fairness_signal.py``): the fluid fair-share reference per
lane over a sliding window, exported as ``tokenfair_fluid_*`` and in ``/status``.

Behaviours under test:

* through real HTTP on loopback (the cost-model engine), a tenant held back by its budget
  while another is served shows as served below its fluid share: ``/metrics`` and ``/status``
  give each tenant's ``served / fluid reference``, the lane's Jain index and worst ratio as
  worked out by hand from the request records, as the report computes them over the same
  records (``fairness_report``), and as a :class:`FluidWindow` fed those records computes them;
  the figures are taken at an injected clock time, never the wall clock's;
* a hand-worked case on a fake clock (two tenants, one refused while the other runs: Jain 0.5,
  worst ratio 0), and nothing shown before the fluid server has settled past the requests;
* bounded cardinality: at 10,000 tenants a lane has ``fairnessTopTenants`` named series plus
  ``other``, and Jain and the worst ratio are still over every tenant;
* a reload that changes weights starts a new window; one that changes nothing of the reference
  keeps it;
* the app's task refreshes the figures on its own;
* ``fairnessWindowSeconds`` / ``--fairness-window`` and ``fairnessTopTenants`` /
  ``--fairness-top-tenants`` are checked, a bad value refused naming the key or flag and rule.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from clock_support import ManualClock
from prometheus_client.parser import text_string_to_metric_families
from sidecar_support import (
    CHAT,
    IDE,
    ClientFactory,
    completion_body,
    lesson_tenants_with_keys,
    records_of,
    start,
    wait_for,
)

from tokenfair.cli import build_parser
from tokenfair.commands.sidecar import settings_for
from tokenfair.config import (
    Config,
    ConfigError,
    PolicyConfig,
    PriorityClass,
    TenantConfig,
    build_config,
)
from tokenfair.core import DEFAULT_POLICY, Decision, make_scheduler
from tokenfair.core.cost import CostModel
from tokenfair.records.codec import read_decisions
from tokenfair.server import SIDECAR, create_admin_app, create_app, make_backend
from tokenfair.server.fairness_signal import FairnessSignal
from tokenfair.server.metrics import FluidFairnessCollector, Metrics
from tokenfair.server.runtime_settings import SidecarSettings, settings_from_section
from tokenfair.sim.fairness import decision_size, fairness_report, jain_index
from tokenfair.sim.fluid_window import OTHER, FluidWindow

A, B = "tenant_chat_pro", "tenant_ide_assist"  # both interactive, weights 2.0 and 1.5
LONG_WAIT_MS = 600_000.0
"""Ten model minutes (60 real seconds at time_scale 0.1): B's refused requests stay demand for
the fluid server over the whole test, however slowly the machine runs it."""


def fluid_samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``tokenfair_fluid_*`` samples of a scrape: family -> sorted labels -> value."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("tokenfair_fluid_"):
            for sample in family.samples:
                labels = tuple(sorted(sample.labels.items()))
                out.setdefault(sample.name, {})[labels] = sample.value
    return out


def starved_config() -> Config:
    """The lesson's tenants; B's budget holds one 4,000-token request (burst 5,000, refilled at
    1 token/s), so its next ones are refused ``shed_tenant_token_quota``."""
    tenants = [
        replace(t, burst_service_tokens=5000, sustained_service_tokens_per_second=1.0)
        if t.tenant_id == B
        else t
        for t in lesson_tenants_with_keys()
    ]
    policy = PolicyConfig(max_interactive_wait_ms=LONG_WAIT_MS, max_batch_wait_ms=LONG_WAIT_MS)
    return build_config(policy, tenants, "test-1")


async def post(proxy: TestClient[Any, Any], authorization: str) -> int:
    # 1000 prompt tokens (chars4) + 4 x 750 decode: 4,000 service tokens
    response = await proxy.post(
        "/v1/completions", json=completion_body(1000, 750), headers={"Authorization": authorization}
    )
    await response.read()
    return response.status


async def test_a_tenant_held_back_shows_below_its_fluid_share(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    config = starved_config()
    records = tmp_path / "records.jsonl"
    settings = SidecarSettings(
        time_scale=0.1, records_path=str(records), access_log="off", fairness_window_s=86_400.0
    )
    clients = await start(aiohttp_client, config, settings)
    proxy, sidecar = clients.proxy, clients.sidecar
    # B first: one request served, then two refused by its budget (demand for the fluid server
    # until their wait limit); then A's six, which the lane serves while B's demand waits.
    first = asyncio.create_task(post(proxy, IDE))
    assert await wait_for(lambda: sidecar.scheduler.running >= 1)
    refused = [await post(proxy, IDE), await post(proxy, IDE)]
    served = await asyncio.gather(first, *(post(proxy, CHAT) for _ in range(6)))
    assert refused == [429, 429]
    assert served == [200] * 7
    assert await wait_for(lambda: len(records_of(sidecar)) == 9)

    # The figures at an injected time: the fluid server settled past every request.
    now_ms = sidecar.clock.now_ms() + sidecar.fairness.settle_ms
    sidecar.fairness.refresh(now_ms)
    scrape = await clients.admin.get("/metrics")
    samples = fluid_samples(await scrape.text())
    status = await (await clients.admin.get("/status")).json()

    (policy,) = read_decisions(records).values()
    by_tenant: dict[str, list[Decision]] = {A: [], B: []}
    for decision in policy:
        by_tenant[decision.tenant_id].append(decision)
    size = {t: sum(decision_size(d, None) for d in ds) for t, ds in by_tenant.items()}
    received = {
        t: sum(decision_size(d, None) for d in ds if d.status_code == 200)
        for t, ds in by_tenant.items()
    }
    # By hand: B has demand from its first arrival to the end (its refused requests wait ten
    # model minutes), so the fluid server gives it all its demand — alone at first, 1.5/3.5 of
    # the lane beside A after, which covers the rest — and A what the lane served beyond that.
    lane_total = received[A] + received[B]
    reference = {B: float(size[B]), A: float(lane_total - size[B])}
    expected = {t: received[t] / reference[t] for t in (A, B)}
    assert expected[B] < 0.5 < 1 < expected[A]
    expected_jain = jain_index(list(expected.values()))
    assert expected_jain is not None
    assert expected_jain < 0.9  # under the alert's threshold

    lane = (("lane", "interactive"),)
    assert samples["tokenfair_fluid_jain"][lane] == pytest.approx(expected_jain, rel=1e-9)
    assert samples["tokenfair_fluid_worst_ratio"][lane] == pytest.approx(expected[B], rel=1e-9)
    ratios = samples["tokenfair_fluid_served_ratio"]
    for tenant in (A, B):
        key = (("lane", "interactive"), ("tenant", tenant))
        assert ratios[key] == pytest.approx(expected[tenant], rel=1e-9)
    assert len(ratios) == 2  # the batch lane had no traffic: no series
    assert ("lane", "batch") not in {k[0] for k in samples["tokenfair_fluid_jain"]}

    # The report over the same records (the fluid reference in one batch computation).
    report = fairness_report(policy, config)
    assert report.fluid_jain_by_lane["interactive"] == pytest.approx(expected_jain, rel=1e-9)
    for tenant in (A, B):
        assert report.tenants[tenant].served_over_fluid == pytest.approx(expected[tenant])

    # A FluidWindow fed the records, settled to the same time: the same figures.
    window = FluidWindow(config, window_ms=86_400_000.0)
    for decision in policy:
        window.observe(decision, decision_size(decision, None))
    window.advance(now_ms)
    figures = window.snapshot().lanes["interactive"]
    assert samples["tokenfair_fluid_jain"][lane] == pytest.approx(figures.jain, rel=1e-12)
    assert figures.worst is not None
    assert figures.worst.tenant_id == B

    # /status: the same figures, and the worst tenant by name.
    fairness = status["fairness"]
    assert fairness["window_seconds"] == 86_400.0
    assert fairness["late_requests"] == 0
    interactive = fairness["window"]["lanes"]["interactive"]
    assert interactive["jain"] == pytest.approx(expected_jain, rel=1e-9)
    assert interactive["worst"]["tenant"] == B
    assert interactive["worst"]["served_over_fluid"] == pytest.approx(expected[B], rel=1e-9)
    rows = {row["tenant"]: row for row in interactive["tenants"]}
    assert set(rows) == {A, B}
    assert rows[B]["received_service_tokens"] == pytest.approx(received[B])
    assert rows[B]["reference_service_tokens"] == pytest.approx(reference[B])
    assert fairness["window"]["lanes"]["batch"]["jain"] is None


# ---------------------------------------------------------------------------------------------
# A hand-worked case on a fake clock

RATE = 1.0  # service tokens per ms
WAIT_MS = 400.0
HAND_CONFIG = build_config(
    PolicyConfig(service_tokens_per_ms=RATE, max_interactive_wait_ms=WAIT_MS),
    [TenantConfig(name, 1.0, 10**9, 10**9, "interactive") for name in ("a", "b")],
)


def served(request_id: str, tenant: str, size: int, arrival_ms: float, dispatch_ms: float,
           lane: PriorityClass = "interactive") -> Decision:  # fmt: skip
    decision = Decision(request_id, tenant, lane, 200, "admitted", "dispatch", size, arrival_ms,
                        dispatch_ms=dispatch_ms)  # fmt: skip
    decision.actual_service_tokens = size
    return decision


def refused(request_id: str, tenant: str, size: int, arrival_ms: float) -> Decision:
    return Decision(request_id, tenant, "interactive", 429, "shed_queue_wait_slo", "admission",
                    size, arrival_ms)  # fmt: skip


def scrape_of(signal: FairnessSignal) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    config = HAND_CONFIG
    scheduler = make_scheduler(DEFAULT_POLICY, config, 0.0)
    metrics = Metrics(lambda: (scheduler, False, config.version, ""))
    metrics.registry.register(FluidFairnessCollector(signal))
    return fluid_samples(metrics.render())


async def test_the_refresh_task_refreshes_once_per_interval_of_its_clock() -> None:
    clock = ManualClock()
    model_ms = [0.0]
    signal = FairnessSignal(
        HAND_CONFIG, now_ms=lambda: model_ms[0], refresh_interval_s=1.0, clock=clock
    )
    task = asyncio.create_task(signal.run())
    try:
        await asyncio.sleep(0)  # the task waits on the clock now
        clock.advance(0.999)
        await asyncio.sleep(0)
        assert signal.refreshed_at_ms is None  # not a moment early
        model_ms[0] = 1000.0
        assert clock.advance(0.001) == 1
        await asyncio.sleep(0)
        assert signal.refreshed_at_ms == 1000.0
        model_ms[0] = 3500.0
        assert clock.advance(2.5) == 1  # the next wait starts after the refresh: one more
        await asyncio.sleep(0)
        assert signal.refreshed_at_ms == 3500.0
        assert clock.pending == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert clock.pending == 0  # a cancelled wait leaves no timer behind


def test_a_hand_worked_case_on_a_fake_clock() -> None:
    clock = [0.0]
    signal = FairnessSignal(HAND_CONFIG, now_ms=lambda: clock[0], window_s=60.0)
    # a runs 1,000 tokens over [0, 1000] ms; b's 1,000 arrive at 0 and are refused (demand
    # until 0 + WAIT_MS). Fluid, weights 1:1: each 0.5/ms over [0, 400] (200 each), then a
    # alone over [400, 1000] (600): a 1000 / 800 = 1.25, b 0 / 200 = 0.
    # Jain = 1.25² / (2 · 1.25²) = 0.5; the worst ratio is b's, 0.
    signal.completed(refused("r2", "b", 1000, 0.0), 429)
    signal.completed(served("r1", "a", 1000, 0.0, 0.0), 200)
    clock[0] = 1000.0 + signal.settle_ms - 1.0  # the fluid server 1 ms short of the end
    signal.refresh()
    early = scrape_of(signal)
    interactive = (("lane", "interactive"),)
    # a has received 999 of its 1,000 and its reference is 799 at 999 ms
    assert early["tokenfair_fluid_served_ratio"][(*interactive, ("tenant", "a"))] == (
        pytest.approx(999 / 799)
    )
    clock[0] = 1000.0 + signal.settle_ms
    signal.refresh()
    samples = scrape_of(signal)
    assert samples["tokenfair_fluid_jain"] == {interactive: pytest.approx(0.5)}
    assert samples["tokenfair_fluid_worst_ratio"] == {interactive: 0.0}
    assert samples["tokenfair_fluid_served_ratio"] == {
        (*interactive, ("tenant", "a")): pytest.approx(1.25),
        (*interactive, ("tenant", "b")): 0.0,
    }
    assert samples["tokenfair_fluid_window_seconds"] == {(): pytest.approx(1.0)}
    assert samples["tokenfair_fluid_late_requests_total"] == {(): 0.0}


def test_nothing_is_shown_before_the_first_refresh_or_settling() -> None:
    clock = [0.0]
    signal = FairnessSignal(HAND_CONFIG, now_ms=lambda: clock[0])
    signal.completed(served("r1", "a", 1000, 0.0, 0.0), 200)
    assert "tokenfair_fluid_jain" not in scrape_of(signal)
    assert signal.status()["window"] is None
    clock[0] = 1000.0  # the fluid server is settle_ms behind: still before the request
    signal.refresh()
    assert "tokenfair_fluid_jain" not in scrape_of(signal)


def test_an_outcome_other_than_the_cores_decides_served_or_not() -> None:
    # a's request was dispatched (the core's 200) but its client met 502: not served, so a is
    # demand until its wait limit and b's, run over [0, 1000], is all the lane served: the
    # hand-worked case above with the tenants' roles swapped (a 0, b 1.25).
    signal = FairnessSignal(HAND_CONFIG, now_ms=lambda: 0.0)
    failed = served("r1", "a", 1000, 0.0, 0.0)
    signal.completed(failed, 502)
    signal.completed(served("r2", "b", 1000, 0.0, 0.0), 200)
    assert failed.status_code == 200  # the sidecar's decision is not changed
    signal.refresh(2000.0 + signal.settle_ms)
    ratios = scrape_of(signal)["tokenfair_fluid_served_ratio"]
    assert ratios == {
        (("lane", "interactive"), ("tenant", "a")): 0.0,
        (("lane", "interactive"), ("tenant", "b")): pytest.approx(1.25),
    }


# ---------------------------------------------------------------------------------------------
# Bounds, reloads, the refresh task


def test_ten_thousand_tenants_make_a_bounded_number_of_series() -> None:
    tenants = [TenantConfig(f"t{i:05d}", 1.0, 10**9, 10**9, "interactive") for i in range(10_000)]
    tenants.append(TenantConfig("batch-1", 1.0, 10**9, 10**9, "batch"))
    config = build_config(PolicyConfig(service_tokens_per_ms=RATE), tenants)
    signal = FairnessSignal(config, now_ms=lambda: 0.0, window_s=10.0, top_tenants=3)
    # Every tenant sends one request at 0; the lane serves them one after another (~40 s),
    # each of size 1 + i % 7. Over the last 10 s the fluid server shares the lane among all
    # the tenants still waiting while the lane served a few of them: the ratios differ.
    start_ms = 0.0
    for i, tenant in enumerate(tenants[:-1]):
        size = 1 + i % 7
        signal.completed(served(f"r{i}", tenant.tenant_id, size, 0.0, start_ms), 200)
        start_ms += size / RATE
    signal.completed(served("rb", "batch-1", 5, start_ms - 10.0, start_ms - 10.0, "batch"), 200)
    latest = signal.refresh(start_ms + signal.settle_ms)
    samples = scrape_of(signal)
    ratios = samples["tokenfair_fluid_served_ratio"]
    interactive = [dict(k)["tenant"] for k in ratios if dict(k)["lane"] == "interactive"]
    assert len(interactive) == 4  # the top 3 and other
    assert OTHER in interactive
    assert {dict(k)["tenant"] for k in ratios if dict(k)["lane"] == "batch"} == {"batch-1"}
    # Jain over all 10,000, not over the series shown
    figures = latest.lanes["interactive"]
    assert figures.jain is not None
    assert figures.jain < 1.0
    assert samples["tokenfair_fluid_jain"][(("lane", "interactive"),)] == figures.jain
    assert figures.worst is not None
    assert figures.worst.tenant_id not in interactive


def test_a_reload_that_changes_weights_starts_a_new_window() -> None:
    signal = FairnessSignal(HAND_CONFIG, now_ms=lambda: 0.0)
    signal.completed(served("r1", "a", 1000, 0.0, 0.0), 200)
    signal.refresh(1000.0 + signal.settle_ms)
    assert signal.latest is not None
    signal.reconfigure(replace(HAND_CONFIG, version="v2"))  # nothing of the reference
    assert signal.latest is not None
    assert signal.status()["window"] is not None
    reweighted = build_config(
        HAND_CONFIG.policy,
        [replace(t, weight=3.0) if t.tenant_id == "a" else t for t in HAND_CONFIG.tenants],
    )
    signal.reconfigure(reweighted)
    assert signal.latest is None
    assert signal.status()["window"] is None
    signal.refresh(2000.0 + signal.settle_ms)
    assert "tokenfair_fluid_jain" not in scrape_of(signal)  # a new window: a's request is gone


async def test_the_app_refreshes_the_figures_on_its_own(aiohttp_client: ClientFactory) -> None:
    config = starved_config()
    settings = SidecarSettings(time_scale=0.01, access_log="off")
    app = create_app(settings, config, make_backend(settings, CostModel.from_policy(config.policy)))
    sidecar = app[SIDECAR]
    sidecar.fairness.refresh_interval_s = 0.01
    await aiohttp_client(app)
    admin = await aiohttp_client(create_admin_app(sidecar))
    assert sidecar.fairness.refreshed_at_ms is None
    assert await wait_for(lambda: sidecar.fairness.refreshed_at_ms is not None)
    status = await (await admin.get("/status")).json()
    assert status["fairness"]["refreshed_at_ms"] is not None
    assert status["fairness"]["top_tenants"] == 10


# ---------------------------------------------------------------------------------------------
# Settings


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"fairnessWindowSeconds": 0}, "sidecar.fairnessWindowSeconds: must be in [1, 86400]"),
        ({"fairnessWindowSeconds": 90_000}, "sidecar.fairnessWindowSeconds: must be in [1, 86400]"),
        ({"fairnessWindowSeconds": True}, "sidecar.fairnessWindowSeconds: must be a number"),
        ({"fairnessTopTenants": 101}, "sidecar.fairnessTopTenants: must be in [0, 100]"),
        ({"fairnessTopTenants": 2.5}, "sidecar.fairnessTopTenants: must be an integer"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{_escaped(message)}"):
        settings_from_section(section)


def test_the_flags_set_the_window_and_are_checked() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["sidecar", "--config", "x.yaml", "--fairness-window", "60", "--fairness-top-tenants", "3"]
    )
    settings = settings_for(args, {"fairnessWindowSeconds": 600})
    assert (settings.fairness_window_s, settings.fairness_top_tenants) == (60.0, 3)
    assert settings_from_section({}).fairness_window_s == 300.0
    args = parser.parse_args(["sidecar", "--config", "x.yaml", "--fairness-window", "0.5"])
    with pytest.raises(ConfigError, match=r"^--fairness-window: must be in \[1, 86400\]"):
        settings_for(args, {})


def _escaped(text: str) -> str:
    return text.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")


def test_the_window_is_checked_where_it_is_built() -> None:
    with pytest.raises(ValueError, match=r"window_s must be in \[1, 86400\]"):
        FairnessSignal(HAND_CONFIG, now_ms=lambda: 0.0, window_s=math.inf)
    with pytest.raises(ValueError, match=r"top_tenants must be in \[0, 100\]"):
        FairnessSignal(HAND_CONFIG, now_ms=lambda: 0.0, top_tenants=-1)
