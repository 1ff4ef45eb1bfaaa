"""A request's lifecycle has one owner (``server/lifecycle.py``).

Behaviours: phases move only forward, each move from one phase only (anything else is a
``LifecycleError`` naming both phases); the one outcome follows from how the request ended
(a refusal, an expiry, a cancellation, a drain, or the answer its client met); ``end`` is
exactly once — a second call writes nothing; and whatever raises at any step of a request's
path (metrics, headers, the backend, the KV hold time, the dispatcher's settlement, the
accounting), the request ends in one record with the outcome its client saw, the next request
is served (one slot: a leak would block it) and the books return to zero.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from sidecar_support import (
    CHAT,
    ZERO_BOOKS,
    ClientFactory,
    Clients,
    books_when_settled,
    completion_body,
    keyed_config,
    records_of,
    start,
)

from tokenfair.core import Decision, Request
from tokenfair.server import lifecycle as lifecycle_module
from tokenfair.server.lifecycle import (
    CLIENT_LEFT,
    Lifecycle,
    LifecycleError,
    Outcome,
    Phase,
    Settlement,
    begin,
)
from tokenfair.server.runtime_settings import SidecarSettings


def chat_request(request_id: str = "r-1", decode_tokens: int = 90) -> Request:
    # 280 + 4 * 90 = 640 service tokens.
    return Request(request_id, "tenant_chat_pro", 0.0, 280, decode_tokens, "interactive")


def decision(status_code: int, reason: str, dispatch_ms: float | None = None) -> Decision:
    return Decision(
        request_id="r-1",
        tenant_id="tenant_chat_pro",
        priority_class="interactive",
        status_code=status_code,
        reason=reason,
        gate="queue",
        service_tokens=640,
        arrival_ms=0.0,
        dispatch_ms=dispatch_ms,
    )


# -- the phase machine --------------------------------------------------------------------------


def test_moves_go_forward_from_one_phase_only() -> None:
    lifecycle = Lifecycle(chat_request(), Phase.QUEUED)
    lifecycle.dispatched(decision(200, "admitted", dispatch_ms=1.0), at_s=0.0)
    assert lifecycle.phase is Phase.RUNNING
    assert lifecycle.ran
    with pytest.raises(LifecycleError, match="cannot move from running to left_queue"):
        lifecycle.left_queue(decision(429, "shed_queue_timeout"))
    lifecycle.settled(Settlement.AS_REPORTED, 600)
    assert (lifecycle.phase, lifecycle.booked_service_tokens) == (Phase.SETTLED, 600)
    with pytest.raises(LifecycleError, match="only from running"):
        lifecycle.settled(Settlement.AS_REPORTED, 700)
    assert lifecycle.booked_service_tokens == 600  # the refused move changed nothing


def test_the_outcome_follows_from_how_the_request_ended() -> None:
    met = Outcome(200, "admitted")
    refused = Lifecycle(chat_request(), Phase.REFUSED, decision=decision(429, "queue_full"))
    assert refused.outcome_of(met) == Outcome(429, "queue_full")
    expired = Lifecycle(chat_request(), Phase.QUEUED)
    expired.left_queue(decision(429, "shed_queue_timeout"))
    assert expired.outcome_of(met) == Outcome(429, "shed_queue_timeout")
    drained = Lifecycle(chat_request(), Phase.QUEUED)
    drained.left_queue(decision(499, "cancelled"), drained=True)
    assert drained.outcome_of(met) == Outcome(503, "draining")
    cancelled = Lifecycle(chat_request(), Phase.QUEUED)
    cancelled.left_queue(decision(499, "cancelled"))
    assert cancelled.outcome_of(met) == Outcome(499, "cancelled")
    ran = Lifecycle(chat_request(), Phase.QUEUED)
    ran.dispatched(decision(200, "admitted", dispatch_ms=0.0), at_s=0.0)
    assert ran.outcome_of(met) == met  # as its client met it
    assert ran.outcome_of(CLIENT_LEFT) == Outcome(499, "cancelled")


# -- end: exactly once ---------------------------------------------------------------------------


async def test_end_is_exactly_once(aiohttp_client: ClientFactory, tmp_path: Path) -> None:
    settings = SidecarSettings(time_scale=0.01, records_path=str(tmp_path / "records.jsonl"))
    clients = await start(aiohttp_client, keyed_config(), settings)
    sidecar = clients.sidecar
    lifecycle = begin(sidecar.ports, chat_request())
    assert lifecycle.phase is Phase.RUNNING  # an idle server dispatches at once
    first = lifecycle.complete(sidecar.ports, Outcome(200, "admitted"))
    assert phase_of(lifecycle) is Phase.SETTLED
    second = lifecycle.complete(sidecar.ports, Outcome(500, "internal_error"))
    assert first == second == Outcome(200, "admitted")
    # A request no configuration admits is refused; whoever answers it ends it, once.
    refused = begin(sidecar.ports, chat_request("r-2", decode_tokens=10**6))
    assert refused.phase is Phase.REFUSED
    assert refused.outcome is None
    assert refused.complete(sidecar.ports) == Outcome(400, "request_over_kv_capacity")
    assert refused.complete(sidecar.ports, Outcome(500, "internal_error")) == refused.outcome
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    rows = records_of(sidecar)
    assert [(row["request_id"], row["status_code"]) for row in rows] == [("r-1", 200), ("r-2", 400)]


# -- whatever raises, one record with the true outcome, and nothing leaks ------------------------


FAULTS = {
    # where: (object path on the sidecar, attribute, the outcome the client sees)
    "dispatch-metrics": ("outcomes", "dispatched", Outcome(500, "internal_error")),
    "ratelimit-headers": ("ratelimits", "headers", Outcome(500, "internal_error")),
    "backend": ("backend", "respond", Outcome(500, "internal_error")),
    "kv-hold-time": ("backend", "kv_hold_ms", Outcome(200, "admitted")),
    "dispatcher-complete": ("dispatcher", "complete", Outcome(200, "internal_error")),
    "accounting": ("outcomes", "count", Outcome(200, "admitted")),
    "access-log-and-span": ("outcomes", "observe", Outcome(200, "admitted")),
    "fairness-signal": ("fairness", "completed", Outcome(200, "admitted")),
    # The core failing while dispatching (a bug): the pump logs it and tries again shortly.
    "core-dispatch": ("scheduler", "next_dispatch", Outcome(200, "admitted")),
    "core-expiry": ("scheduler", "expire", Outcome(200, "admitted")),
    "core-wakeup": ("scheduler", "next_wakeup_ms", Outcome(200, "admitted")),
}


@pytest.mark.parametrize("where", list(FAULTS))
async def test_a_fault_anywhere_is_one_record_and_no_leak(
    aiohttp_client: ClientFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    path, attribute, expected = FAULTS[where]
    settings = SidecarSettings(
        time_scale=0.01, max_in_flight=1, records_path=str(tmp_path / "records.jsonl")
    )
    clients = await start(aiohttp_client, keyed_config(), settings)
    sidecar = clients.sidecar
    target = getattr(sidecar, path) if path else sidecar
    original = getattr(target, attribute)
    faults = 0

    def broken_once(*args: Any, **kwargs: Any) -> Any:
        nonlocal faults
        if faults == 0:
            faults += 1
            raise RuntimeError(f"injected fault at {where}")
        return original(*args, **kwargs)

    async def broken_once_async(*args: Any, **kwargs: Any) -> Any:
        nonlocal faults
        if faults == 0:
            faults += 1
            raise RuntimeError(f"injected fault at {where}")
        return await original(*args, **kwargs)

    broken = broken_once_async if asyncio.iscoroutinefunction(original) else broken_once
    monkeypatch.setattr(target, attribute, broken)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    responses: list[aiohttp.ClientResponse] = []
    for _ in range(2):  # one slot: a leaked one would hold the second until the timeout
        async with asyncio.timeout(30):
            response = await clients.proxy.post(
                "/v1/chat/completions", json=body, headers={"Authorization": CHAT}
            )
            await response.read()
        responses.append(response)
    assert faults == 1
    assert [r.status for r in responses] == [expected.status_code, 200]
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    rows = records_of(sidecar)
    assert [row["request_id"] for row in rows] == [r.headers["x-request-id"] for r in responses]
    outcomes = [Outcome(row["status_code"], row["reason"]) for row in rows]
    assert outcomes == [expected, Outcome(200, "admitted")]


async def _one_request_with(
    aiohttp_client: ClientFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    faults: set[tuple[str, str]],
) -> tuple[Clients, int, list[object]]:
    """One chat request with each ``(part, method)`` of the sidecar raising, returned once its
    handler has ended; the fairness signal's calls are recorded, whether it raises or not."""
    settings = SidecarSettings(
        time_scale=0.01, max_in_flight=1, records_path=str(tmp_path / "records.jsonl")
    )
    clients = await start(aiohttp_client, keyed_config(), settings)
    fairness_calls: list[object] = []
    for part, method in faults:
        target = getattr(clients.sidecar, part)

        def broken(*args: Any, _where: str = f"{part}.{method}", **kwargs: Any) -> Any:
            if _where == "fairness.completed":
                fairness_calls.append(_where)
            raise RuntimeError(f"injected fault at {_where}")

        monkeypatch.setattr(target, method, broken)
    if ("fairness", "completed") not in faults:
        original = clients.sidecar.fairness.completed

        def seen(*args: Any, **kwargs: Any) -> None:
            fairness_calls.append("fairness.completed")
            original(*args, **kwargs)

        monkeypatch.setattr(clients.sidecar.fairness, "completed", seen)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with asyncio.timeout(30):
        response = await clients.proxy.post(
            "/v1/chat/completions", json=body, headers={"Authorization": CHAT}
        )
        await response.read()
        # The client may have its answer before the handler's completion ran (a whole answer is
        # recorded once written): wait for the handler to end, then read what it did.
        while clients.sidecar.dispatcher.handlers:
            await asyncio.sleep(0.01)
    return clients, response.status, fairness_calls


async def test_a_failing_log_line_and_span_still_reach_the_fairness_signal(
    aiohttp_client: ClientFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sink's own guard around the access-log line and span: without it the fault would
    skip the fairness signal (the lifecycle's last resort would still end the request)."""
    clients, status, fairness_calls = await _one_request_with(
        aiohttp_client, tmp_path, monkeypatch, {("outcomes", "observe")}
    )
    assert status == 200
    assert fairness_calls == ["fairness.completed"]
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS
    assert [row["reason"] for row in records_of(clients.sidecar)] == ["admitted"]


async def test_the_sink_keeps_a_failing_fairness_signal_to_itself(
    aiohttp_client: ClientFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``Outcomes.completed`` never raises: the fairness signal's fault is logged there, and
    the lifecycle's last resort never sees it."""
    clients, status, fairness_calls = await _one_request_with(
        aiohttp_client, tmp_path, monkeypatch, {("fairness", "completed")}
    )
    assert status == 200
    assert fairness_calls == ["fairness.completed"]
    assert "the fairness signal failed" in caplog.text
    assert "the outcome sink raised" not in caplog.text
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


async def test_a_sink_that_raises_anyway_ends_the_request_cleanly(
    aiohttp_client: ClientFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The lifecycle's last resort: an outcome sink that breaks its promise (a bug) is logged;
    the client has its answer, the slot and KV are free, the handler leaves the dispatcher."""
    clients, status, _ = await _one_request_with(
        aiohttp_client, tmp_path, monkeypatch, {("outcomes", "completed")}
    )
    assert status == 200
    assert "the outcome sink raised" in caplog.text  # after the handler left the dispatcher
    assert await books_when_settled(clients.sidecar) == ZERO_BOOKS


def phase_of(lifecycle: Lifecycle) -> Phase:
    """The phase now (a call: mypy does not carry an earlier ``assert`` on it past a move)."""
    return lifecycle.phase


async def test_a_shed_with_no_wait_left_is_not_retried_within_a_millisecond(
    aiohttp_client: ClientFactory,
) -> None:
    """``shed_queue_timeout`` carries ``retry_after_ms`` 0 (the request waited its whole limit):
    ``retry-after-ms`` is then the 1 s fallback, not 1 ms (the openai SDK takes any positive
    value as is and would send the retry straight back into the queue)."""
    clients = await start(aiohttp_client, keyed_config())
    sidecar = clients.sidecar
    shed = decision(429, "shed_queue_timeout")
    shed.retry_after_ms = 0.0
    ratelimits = sidecar.ratelimits
    assert (ratelimits.retry_after_ms(shed), ratelimits.retry_after_s(shed)) == (1000, 1)
    waited = decision(429, "shed_queue_wait_slo")
    waited.retry_after_ms = 12.0  # model ms at time_scale 0.01: 0.12 real ms, rounded up
    assert ratelimits.retry_after_ms(waited) == 1


# -- refusals: the record says what the client got -------------------------------------------------


async def test_a_refusal_that_cannot_be_answered_is_recorded_as_the_500_sent(
    aiohttp_client: ClientFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A door refusal whose answer fails to build is a JSON 500 recorded as such (not the 429
    the gate decided): the answer is built before the request ends."""
    settings = SidecarSettings(time_scale=0.01, records_path=str(tmp_path / "records.jsonl"))
    # A bucket that refills 1 service token a second: the second 900-token request cannot be
    # covered within the wait limit and is refused at the door.
    config = keyed_config(burst_service_tokens=1000, sustained_service_tokens_per_second=1.0)
    clients = await start(aiohttp_client, config, settings)
    sidecar = clients.sidecar
    body = completion_body(500, 100)  # 500 + 4 * 100 = 900 service tokens
    auth = {"Authorization": CHAT}
    first = await clients.proxy.post("/v1/completions", json=body, headers=auth)
    assert first.status == 200

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected fault while answering a refusal")

    monkeypatch.setattr(sidecar.ratelimits, "retry_after_ms", broken)
    second = await clients.proxy.post("/v1/completions", json=body, headers=auth)
    assert second.status == 500
    assert (await second.json())["error"]["code"] == "internal_error"
    monkeypatch.undo()
    third = await clients.proxy.post("/v1/completions", json=body, headers=auth)
    assert third.status == 429
    assert (await third.json())["error"]["tokenfair_reason"] == "shed_tenant_token_quota"
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    rows = records_of(sidecar)
    assert [row["request_id"] for row in rows] == [
        r.headers["x-request-id"] for r in (first, second, third)
    ]
    assert [Outcome(row["status_code"], row["reason"]) for row in rows] == [
        Outcome(200, "admitted"),
        Outcome(500, "internal_error"),
        Outcome(429, "shed_tenant_token_quota"),
    ]


async def test_a_request_reaching_admission_during_a_drain_is_a_recorded_503(
    aiohttp_client: ClientFactory, tmp_path: Path
) -> None:
    """A body still arriving when the drain began reaches admission after it: refused
    ``503 draining`` (never queued behind the drain), and recorded so."""
    settings = SidecarSettings(time_scale=0.01, records_path=str(tmp_path / "records.jsonl"))
    clients = await start(aiohttp_client, keyed_config(), settings)
    sidecar = clients.sidecar
    sidecar.dispatcher.draining = True  # as `drain()` leaves it, after the handler's first check
    lifecycle = begin(sidecar.ports, chat_request())
    assert lifecycle.phase is Phase.REFUSED
    assert lifecycle.decision is not None
    assert (lifecycle.decision.status_code, lifecycle.decision.reason) == (503, "draining")
    assert lifecycle.complete(sidecar.ports) == Outcome(503, "draining")
    # A request cut by the drain's abort is recorded as cut, whatever phase it was in.
    waiting = Lifecycle(chat_request("r-2"), Phase.QUEUED)
    waiting.left_queue(decision(499, "cancelled"))
    assert waiting.outcome_of(Outcome(503, "drain_aborted")) == Outcome(503, "drain_aborted")
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    rows = records_of(sidecar)
    assert [(row["request_id"], row["status_code"], row["reason"]) for row in rows] == [
        ("r-1", 503, "draining")
    ]


async def test_a_core_that_cannot_dispatch_ends_its_queue_with_500s(
    aiohttp_client: ClientFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A core whose dispatch keeps failing: the pump backs off (doubling), logs a bounded
    number of lines, and after ``PUMP_FAILURES_TO_GIVE_UP`` failures in a row ends the queued
    requests ``500 internal_error`` — refunded, recorded, nothing held. (Retry delays shrunk
    to milliseconds: the outcome, not the time, is asserted.)"""
    monkeypatch.setattr("tokenfair.server.dispatcher.PUMP_RETRY_S", 0.0005)
    monkeypatch.setattr("tokenfair.server.dispatcher.PUMP_RETRY_MAX_S", 0.002)
    settings = SidecarSettings(time_scale=0.01, records_path=str(tmp_path / "records.jsonl"))
    clients = await start(aiohttp_client, keyed_config(), settings)
    sidecar = clients.sidecar

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected: the core cannot dispatch")

    monkeypatch.setattr(sidecar.scheduler, "next_dispatch", broken)
    with caplog.at_level("ERROR", logger="tokenfair.sidecar"):
        async with asyncio.timeout(30):
            response = await clients.proxy.post(
                "/v1/completions", json=completion_body(10, 10), headers={"Authorization": CHAT}
            )
    assert response.status == 500
    assert (await response.json())["error"]["code"] == "internal_error"
    assert await books_when_settled(sidecar) == ZERO_BOOKS
    rows = records_of(sidecar)
    assert [(row["request_id"], row["status_code"], row["reason"]) for row in rows] == [
        (response.headers["x-request-id"], 500, "internal_error")
    ]
    lines = [r for r in caplog.records if "dispatching" in r.getMessage()]
    assert 2 <= len(lines) <= 6  # the first, the 2nd/4th/8th, the giving up: not one per retry


# -- the lifecycle's ports: no module on the request's path reaches back to the sidecar object -----


def _imported_names(source: str, package: str) -> set[str]:
    """Every dotted name a module's imports reach: ``from a import b`` gives ``a`` and ``a.b``;
    relative imports resolved against ``package``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _reaches_the_sidecar(names: set[str]) -> bool:
    return any(
        name == "tokenfair.server.Sidecar"
        or name == "tokenfair.server.sidecar"
        or name.startswith("tokenfair.server.sidecar.")
        for name in names
    )


def test_no_module_on_the_request_path_imports_the_sidecar_object() -> None:
    """The lifecycle, the dispatcher, the outcome sink, the rate limits and the engine link see
    the sidecar through their ports only: none imports ``tokenfair.server.sidecar`` or the
    package's re-export of ``Sidecar`` (not even for typing, nor relatively), so ``dispatcher →
    lifecycle → state → dispatcher`` cannot close again."""
    server = Path(lifecycle_module.__file__).parent
    for name in ("lifecycle", "dispatcher", "outcomes", "ratelimit", "engine_link"):
        imported = _imported_names((server / f"{name}.py").read_text(), "tokenfair.server")
        assert not _reaches_the_sidecar(imported), name


@pytest.mark.parametrize(
    "line",
    [
        "from tokenfair.server.sidecar import Sidecar",
        "from tokenfair.server import Sidecar",
        "from tokenfair.server import sidecar",
        "from .sidecar import Sidecar",
        "from . import sidecar",
        "import tokenfair.server.sidecar",
    ],
)
def test_the_rule_sees_every_way_to_import_the_sidecar(line: str) -> None:
    assert _reaches_the_sidecar(_imported_names(line + "\n", "tokenfair.server"))
    assert not _reaches_the_sidecar(
        _imported_names("from .clock import ModelClock\n", "tokenfair.server")
    )
