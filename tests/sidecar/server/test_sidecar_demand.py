"""``tokenfair_demand_ratio{lane}`` live: real HTTP over loopback, the cost-model backend.

Behaviours: the gauge is exported per lane; once the requests have settled it is the service
tokens offered in the last wait limit over ``serviceTokensPerMs * wait limit`` — admitted
requests count, a refusal for a tenant's budget does not (capacity refusals do:
tests/sidecar/sim/test_autoscale.py); a reload that changes the wait limit is followed at once;
the offers leave the window a wait limit after they arrived. The sidecar's model clock is the
test's (it moves only when told), so a slow machine changes nothing.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
from sidecar_support import (
    CHAT,
    IDE,
    ZERO_BOOKS,
    ClientFactory,
    books_when_settled,
    completion_body,
    keyed_config,
    start,
)

from tokenfair.config import Config, PolicyConfig, build_config
from tokenfair.server import LoadedFile
from tokenfair.server import sidecar as sidecar_module
from tokenfair.server.clock import ModelClock
from tokenfair.server.reload import apply_config
from tokenfair.server.runtime_settings import SidecarSettings

WAIT_MS = 60_000.0  # the window


class TestClock(ModelClock):
    """Model time that moves only when the test says so (the backend and the KV timers run on
    the event loop's clock, ``time_scale`` real seconds per model second)."""

    __test__ = False

    def __init__(self, time_scale: float = 1.0) -> None:
        super().__init__(time_scale)
        self.model_ms = 1000.0

    def now_ms(self) -> float:
        return self.model_ms


def config_with(policy: PolicyConfig) -> Config:
    base = keyed_config(policy)
    tenants = [
        replace(t, burst_service_tokens=5000, sustained_service_tokens_per_second=0.001)
        if t.tenant_id == "tenant_chat_pro"
        else t
        for t in base.tenants
    ]
    return build_config(policy, tenants, "test-1")


def ratio(metrics: str, lane: str) -> float:
    found = re.search(rf'^tokenfair_demand_ratio{{lane="{lane}"}} (\S+)$', metrics, re.M)
    assert found is not None, metrics
    return float(found.group(1))


async def test_the_gauge_is_offered_service_over_capacity(
    aiohttp_client: ClientFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sidecar_module, "ModelClock", TestClock)
    policy = PolicyConfig(max_interactive_wait_ms=WAIT_MS, max_batch_wait_ms=WAIT_MS)
    rate = policy.service_tokens_per_ms
    settings = SidecarSettings(time_scale=0.01, max_in_flight=1)
    clients = await start(aiohttp_client, config_with(policy), settings)
    clock = clients.sidecar.clock
    assert isinstance(clock, TestClock)
    for authorization, output in ((CHAT, 250), (CHAT, 250), (CHAT, 250), (IDE, 250)):
        response = await clients.proxy.post(
            "/v1/completions",
            json=completion_body(1000, output),
            headers={"Authorization": authorization},
        )
        await response.read()
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    metrics = await (await clients.admin.get("/metrics")).text()
    # Three 2000-token requests offered (the third chat one was refused for its budget: not
    # demand), against the policy's service rate over the 60 s wait limit.
    assert ratio(metrics, "interactive") == pytest.approx(3 * 2000 / (rate * WAIT_MS))
    assert ratio(metrics, "batch") == 0.0
    # A reload halves the wait limit: the same offered tokens over half the capacity-window.
    halved = replace(policy, max_interactive_wait_ms=WAIT_MS / 2)
    apply_config(clients.sidecar, LoadedFile(replace(config_with(halved), version="2"), {}, "2"))
    metrics = await (await clients.admin.get("/metrics")).text()
    assert ratio(metrics, "interactive") == pytest.approx(3 * 2000 / (rate * WAIT_MS / 2))
    # Just within the new limit they still count; once it has passed they have left.
    clock.model_ms += WAIT_MS / 2 - 1.0
    metrics = await (await clients.admin.get("/metrics")).text()
    assert ratio(metrics, "interactive") == pytest.approx(3 * 2000 / (rate * WAIT_MS / 2))
    clock.model_ms += 1.0
    metrics = await (await clients.admin.get("/metrics")).text()
    assert ratio(metrics, "interactive") == 0.0
